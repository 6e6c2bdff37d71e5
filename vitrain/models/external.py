"""Models from other libraries, trained by vitrain as they are: `model.name=timm:NAME` builds timm's model.

timm imports torchvision, and the only torchvision built for torch 2.13 on the registry (0.28.0) is a CUDA build
whose C++ operators cannot load beside the CPU wheel (`operator torchvision::nms does not exist`);
`allow_torchvision_import()` declares those operators' signatures (without kernels) before torchvision looks for
them, so `import timm` works and ViTs never call them.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from collections.abc import Callable

import torch
from torch import nn

from vitrain.config import ModelConfig
from vitrain.errors import ConfigError

TIMM_EXTRA = "pip install 'vitrain[peers]'"

# The signatures of torchvision 0.28's C++ operators (torchvision/csrc/ops/*.cpp), declared without kernels.
TORCHVISION_OPS = """
_cuda_version() -> int
nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor
qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor
box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor
deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, \
SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) \
-> Tensor
_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, \
SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, \
SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)
ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, \
int sampling_ratio) -> (Tensor, Tensor)
_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, SymInt pooled_height, \
SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor
ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) \
-> (Tensor, Tensor)
_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, SymInt pooled_height, \
SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor
qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, \
int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, \
bool aligned) -> Tensor
roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, \
int sampling_ratio, bool aligned) -> Tensor
_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, \
SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor
roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) \
-> (Tensor, Tensor)
_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, \
SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor
"""
_declared: list[torch.library.Library] = []  # a Library's definitions live as long as the object


def allow_torchvision_import() -> bool:
    """Let a torchvision whose C++ operators cannot load import anyway; True when the signatures were declared.

    Nothing is done where torchvision is absent, where its operators are registered already, or where its own
    library loads (a torchvision built for this torch).
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _declared or "torchvision::nms" in torch._C._dispatch_get_all_op_names():
        return False
    for folder in spec.submodule_search_locations or []:
        for library in glob.glob(os.path.join(folder, "_C*.so")):
            with contextlib.suppress(OSError, ImportError, RuntimeError):
                torch.ops.load_library(library)
                return False
    declared = torch.library.Library("torchvision", "DEF")
    for signature in TORCHVISION_OPS.strip().split("\n"):
        declared.define(signature)
    _declared.append(declared)
    return True


def import_timm():  # noqa: ANN201 (the timm module)
    """timm, or a ConfigError saying how to install it."""
    if importlib.util.find_spec("timm") is None:
        raise ConfigError(f"model.name=timm:... needs timm: {TIMM_EXTRA}")
    allow_torchvision_import()
    import timm

    return timm


def timm_model(name: str) -> Callable[[ModelConfig], nn.Module]:
    """`model.name=timm:NAME`: a factory building timm's NAME (random weights) for the config's image size, input
    channels and classes. timm is imported when the model is built, not when the config is read."""

    def build(cfg: ModelConfig) -> nn.Module:
        timm = import_timm()
        if name not in timm.list_models():
            raise ConfigError(f"model.name=timm:{name} is not a timm model; `timm.list_models('vit_*')` lists them")
        return timm.create_model(
            name, pretrained=False, num_classes=cfg.num_classes, in_chans=cfg.in_chans, img_size=cfg.image_size
        )

    return build
