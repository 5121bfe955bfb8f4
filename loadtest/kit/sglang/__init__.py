"""SGLang's own classes under the adapter (pools.py, linker.py). torchvision's `nms`/`qnms`
op schemas are defined here, when the package is first imported: before any module of it
(a test, an engine process) imports SGLang, which imports torchvision (pools.py says why),
whatever order a module's imports are sorted in."""

try:
    import torch

    _TV = torch.library.Library("torchvision", "DEF")  # kept: the definitions live with it
    _TV.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except (ImportError, RuntimeError):  # no torch; or a torchvision that loads defines them
    _TV = None
