"""Parallelism beyond data parallel (issue 14): tensor + sequence, pipeline and context
parallel. ``tensor``, ``context`` and ``pipeline`` are the dimensions' adapters (what one rank
holds of the model, its saved tensors and its schedule), below the step assembly; ``step`` is
the data-parallel step (``memplan.step.Step``) on one rank of the device mesh, and its
``estimate_layout`` is what ``memory.estimate`` returns for a job with a layout. The package
imports none of them, so an adapter is imported without the rank step above it."""
