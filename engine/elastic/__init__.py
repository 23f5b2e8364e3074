"""A world that changes mid-run: ranks lost, ranks healed, joiners admitted, behind one face.

The trainer holds one elastic component, chosen once (``build.py``): :class:`~engine.elastic.face.Fixed` under
``trainer.on_failure=abort`` (a failed collective ends the run; nothing runs per step) or, under ``continue``,
:class:`~engine.elastic.face.Surviving` on a member and :class:`~engine.elastic.joiner.Joiner` on a process started
with ``trainer.join=true`` (the *joiner*). The trainer runs every part of its loop that holds a collective through
``run(phase, part, ...)``, asks ``admit_if_due`` at step boundaries, and applies the ``Resize`` an admission hands
it; it takes every membership change from its one reader of them (``Membership.follow``). A
loss and a join are both a change of the membership at a step boundary the ranks agree on.

**A loss** (``heartbeat.py``, ``failures.py``, ``guard.py``). Every collective has a deadline and every rank beats
in the store. When a collective fails, the survivors check in, agree who is silent, form a new group and redo the
part in flight; a survivor left one collective behind is healed from the front (the lowest rank there sends it the
trainer's state) and enters the loop again where the front is (``CatchUp``, ``positions.Entry``). Beyond 17 ranks on
etcd nobody checks in: the ring's first ranks decide and the decision travels round the ring (``wide.py``).

**A join** (``admissions.py``: the members; ``joiner.py``: the joiner; ``handover.py``: the state on its way;
``records.py``: every store key and record of the two parties). torchrun admits a node by re-rendezvous, which stops
and restarts every worker; here the training group is ours (``Membership.form``, on the run's store), so a process
outside the default group can be in the next one, as torchft's replicas join at its next quorum.

1. The run's logging rank publishes where its store is, ``<run dir>/join.json`` (``JoinFile``).
2. A joiner builds everything it trains with, rehearses one step (``Trainer.rehearse``), then takes a ticket from
   the store (its id in the run: the initial world size plus the ticket, less one, never a rank used before) and
   waits (``Request``).
3. Every member's watcher thread (``Admissions``) sees the ticket within ``POLL_S`` and promises, for the next
   admission, a step it will not pass until the admission step is agreed: its own step plus ``MARGIN``, or the sync
   algorithm's next agreement (``SyncAlgorithm.agreement_at``) within ``ALIGN`` steps of it. The admission step
   (a ``Decision``) is the largest promise, so no member has passed it when it learns it. Once agreed, every party
   forms the new group in the background (*ahead*: the joiner learns of it from its ticket's ``Notice``).
4. At that step (between two steps, or at the start of the next epoch when it is an epoch's last) the members
   settle the replicas as for a checkpoint, write the ticket's ``Admission`` (their view of the membership) and take
   the new group; the sender (the lowest member) sends the joiner the trainer's state; and every member goes on as
   a run resumed from that checkpoint at the new world size would (``Resize``): the sync algorithm built for the new
   world from the shared state (each member keeping its own per-rank state, the joiner starting fresh), the rest of
   the epoch sharded over the new world, the LR of its size.
5. The state travels while everyone trains (``handover.py``), in two parts: the model and all the joiner needs
   before its first forward, which it waits for; then the optimizer's state (and the sync algorithm's shared state
   where that is read only at a step: DiLoCo's outer state), loaded before its first optimizer step. The members
   stand still for the rebuild alone.
6. Where the admission step ends with an averaging of the whole model (local SGD's, DiLoCo's whole outer step), the
   joiner takes the model in it (``InAveraging``, ``SyncContext.guests``): the members offer it a part (an
   ``Offer``), it adds -0.0 and divides the sum as they do, and the first part of the state carries only what was
   not averaged. Where its share needs a state it lacks (DiLoCo's outer parameters and momentum), the sender sends
   that *advance* state before the admission step, once it is final (``SyncAlgorithm.guest_state``).

A member lost in the middle of an admission is survived as anywhere else, and the admission is redone by who is
left. A joiner whose sender is lost before it has the whole state leaves the run (it can ask again): to the members,
a loss like any other.
"""
