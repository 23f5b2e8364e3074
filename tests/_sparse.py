"""A worker entry point for tests/test_sparse.py: sync=diloco with quantize=sparse, every round's inputs and outcome
logged on every rank, for the test to compute the rule by hand."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import record


@record
def logging_sparse_rounds(cfg: dict, run_dir: str) -> None:
    """Each config of ``configs.json`` (``conftest.train_each``) trained with every round logged: each rank saves to
    ``<run>/sparse_rank<r>.pt`` what it sent (its error-feedback buffer before the round, its pseudo-gradient, its
    payload and what that decodes to, the buffer after) and what it applied (the global fragment
    and outer momentum before and after, its own fragment after)."""
    from _workers import _each

    _each(run_dir, _run)


def _run(cfg: dict, run_dir: str) -> None:
    from _workers import fit_saving

    import algorithms.diloco as diloco
    from algorithms.compress import ErrorFeedback

    sends, applies = [], []
    send, apply = ErrorFeedback.send, diloco.DiLoCo._apply

    def logged_send(self, lo, hi, delta, codec):
        before = self.buffer[lo:hi].clone()
        payload, sent = send(self, lo, hi, delta, codec)
        after = self.buffer[lo:hi].clone()
        sends.append({"lo": lo, "before": before, "delta": delta.clone(), "payload": payload.clone(), "sent": sent})
        sends[-1]["after"] = after
        return payload, sent

    def logged_apply(self, sync):
        lo, hi = self.ranges[sync.fragment]
        old, momentum = self.global_params[lo:hi].clone(), self.momentum[lo:hi].clone()
        norm = apply(self, sync)
        local = self.read_range(lo, hi).clone()
        new, momentum_after = self.global_params[lo:hi].clone(), self.momentum[lo:hi].clone()
        applies.append({"fragment": sync.fragment, "old": old, "momentum": momentum, "new": new, "local": local})
        applies[-1]["momentum_after"] = momentum_after
        return norm

    ErrorFeedback.send, diloco.DiLoCo._apply = logged_send, logged_apply
    try:
        fit_saving(cfg, run_dir, "sparse", {"sends": sends, "applies": applies})
    finally:
        ErrorFeedback.send, diloco.DiLoCo._apply = send, apply
