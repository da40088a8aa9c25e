"""edgetune: fine-tune LoRA adapters on a 4-bit model on one GPU.

The code lives in the repository's top-level folders, which the packaging maps to one
package (pyproject's `package-dir`): `edgetune.engine` (engine/), `edgetune.app` (app/),
`edgetune.kernels` (kernels/), `edgetune.presets` (presets/).
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout (editable install) the subpackages are this folder's siblings.
# setuptools' editable finder does not find a mapped subpackage that has no __init__.py
# (pypa/setuptools#4943), and `kernels/` has none on purpose (see pyproject.toml), so a
# checkout also searches the repository root for `edgetune.<name>`. An installed wheel
# has the subpackages inside this folder and skips this.
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "kernels")):
    __path__.append(_os.path.dirname(_here))
