"""edgetune: fine-tune LoRA adapters on a 4-bit model on one GPU.

The code lives in the repository's top-level folders; `edgetune/` holds links to them so
they install as one package: `edgetune.engine` (engine/), `edgetune.app` (app/),
`edgetune.kernels` (kernels/), `edgetune.presets` (presets/).
"""

__version__ = "0.1.0"
