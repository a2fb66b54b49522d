"""kvtune's bundled paged-KV inference engine.

Layers, each owning one invariant: kv (block pool: every block free, used or cached, exactly once)
-> core (scheduler: who runs this step, and why the rest wait) -> runner (model or simulator)
-> engine loop -> server. The kv, core and sim packages import no torch.
"""
__version__ = "0.1.0"
