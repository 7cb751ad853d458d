"""The single-device side of ``Cluster.diff``, in the reference process: ``ReferenceOps``, a
``TorchFunctionMode`` that keeps every op the statement calls on plain tensors as the ranks keep theirs (call
site, op, occurrence; the outputs; the gradient that reaches each output), written to
``group<g>/diff-reference.pt`` for the ranks to compare against (``engine.diff``).
"""

from __future__ import annotations

import os
import traceback

from .recorder import outputs as kept_outputs

__all__ = ["ReferenceOps", "DIFF_REFERENCE_FILE"]

DIFF_REFERENCE_FILE = "diff-reference.pt"


def _reference_mode_class():
    from torch.overrides import TorchFunctionMode

    class ReferenceOps(TorchFunctionMode):
        """The single-device side of the diff: every torch function the statement calls (the calls inside
        one are not seen: the mode is off while it runs, as ShardTensor's hook sees only the outer call),
        kept as the ranks keep theirs (site, op, occurrence; outputs; the gradient reaching the output)."""

        def __init__(self, stmt: str, selected: list[str] | None):
            super().__init__()
            self.stmt = stmt
            self.selected = None if selected is None else set(selected)
            self.counts: dict = {}
            self.ops: dict = {}
            self.errors: list[str] = []
            self.handles: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            try:
                self._keep(func, res)
            except Exception:  # noqa: BLE001 - a bookkeeping failure leaves the op unmatched, the run goes on
                self.errors.append(traceback.format_exc())
            return res

        def _keep(self, func, res) -> None:
            import torch

            from .frames import user_frame
            from .recorder.tensors import op_name, result_tensors

            outs = result_tensors(res)
            if not outs:
                return
            name = op_name(func)
            site = kept_outputs.site_of(user_frame(1), self.stmt)
            count = self.counts[(site, name)] = self.counts.get((site, name), 0) + 1
            if self.selected is not None and name not in self.selected:
                return
            entry = {"outputs": [t.detach().clone() for t in outs], "grad": None}
            self.ops[kept_outputs.op_key(site, name, count)] = entry
            node = outs[0].grad_fn
            if node is not None and isinstance(outs[0], torch.Tensor):
                index = outs[0].output_nr

                def pre_hook(grad_outputs):
                    grad = grad_outputs[index] if index < len(grad_outputs) else None
                    if grad is not None and entry["grad"] is None:
                        entry["grad"] = grad.detach().clone()

                self.handles.append(node.register_prehook(pre_hook))

        def save(self, folder: str) -> None:
            import torch

            for handle in self.handles:
                handle.remove()
            torch.save({"ops": self.ops, "errors": self.errors}, os.path.join(folder, DIFF_REFERENCE_FILE))

    return ReferenceOps


def ReferenceOps(stmt: str, selected: list[str] | None):  # noqa: N802 - a class made on first use (torch import)
    """The reference's op keeper (a ``TorchFunctionMode``; see ``_reference_mode_class``)."""
    return _reference_mode_class()(stmt, selected)
