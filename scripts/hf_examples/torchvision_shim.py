"""Let torchvision's Python part import where its compiled ops cannot load.

PyPI's torchvision wheels for Linux are built against CUDA torch (they link libtorch_cuda); with the CPU build of
torch their ``_C`` extension does not load, and torchvision's import then fails registering fake kernels for two
ops (``nms``, ``qnms``) whose schemas only that extension defines. The example scripts use torchvision's image
transforms alone, which need no compiled op: defining those two schemas first lets the import finish. Nothing is
done where the extension loads (a GPU machine's matching torchvision).
"""

from __future__ import annotations

import importlib.util


def allow_torchvision_without_ops() -> bool:
    """True when the schemas were defined (the extension is missing), False when nothing was needed."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    from pathlib import Path

    import torch

    lib = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if lib is not None:
        try:
            torch.ops.load_library(str(lib))
            return False
        except (OSError, RuntimeError):
            pass
    library = torch.library.Library("torchvision", "DEF")  # kept alive in _KEEP: the schemas live as long as it
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(library)
    return True


_KEEP: list[object] = []
