"""Self-drafting with a mask-gated adapter on the target (Uno / Ψ-Spec) and its diffusion mode.

- ``adapter``: the gated LoRA, its MASK vector and the correction-conditioned readout;
- ``trainer``: self-distillation training (a differentiable forward of the frozen target);
- ``serve``: the ``uno`` / ``uno_tree`` self drafters (one fused verify-and-propose forward,
  or a separate draft pass);
- ``diffusion``: block-wise iterative unmasking with the adapter, and speculation over its
  unmasking trajectory.

Its commands are ``specmesh.cli.uno`` (``train-uno``) and ``specmesh.cli.uno_study``
(``uno-study``).
"""
