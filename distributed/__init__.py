"""The runtime under the engine and the sync algorithms: membership and store agreement, counted communication,
peer schedules, the default process group. Imports only torch."""
