"""Batch normalization whose batch statistics span every rank of the job.

Each rank computes its own count, mean and sum of squared deviations per channel; one
allgather shares them, and every rank combines them into the statistics of the whole
(concatenated) batch, so ranks may hold different numbers of samples. The backward pass
sums the two per-channel reductions the input gradient needs over all ranks with one
allreduce. Weight and bias gradients stay local, like every other parameter's: the
optimizer's gradient averaging combines them.

The arithmetic is written with plain tensor operations because torch's fused
``batch_norm_stats``/``batch_norm_elemt`` kernels exist only for GPUs and ringmaster's
collectives move CPU tensors.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ringmaster.worker.frontend.collectives import Sum
from ringmaster.worker.frontend.differentiable import allgather, allreduce
from ringmaster.worker.frontend.topology import size


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm1d/2d/3d`` with batch statistics computed over all ranks.

    Takes inputs of shape ``(N, C)`` or ``(N, C, ...)`` with up to three trailing
    dimensions. In training mode on more than one rank, normalization uses the mean and
    variance of the batch formed by every rank's input, and ``running_mean``/``running_var``
    are updated as ``torch.nn.BatchNorm`` would update them on that whole batch. In eval
    mode, or on a single rank, it is plain batch normalization. Every rank must call it in
    the same order, as with any collective.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"SyncBatchNorm expects a 2-D to 5-D input shaped (N, C, ...), got a "
                             f"{input.dim()}-D input of shape {tuple(input.shape)}; reshape it so that "
                             f"dimension 1 holds the {self.num_features} channels")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} "
                             f"channels in dimension 1 (shape {tuple(input.shape)}); pass "
                             f"num_features={input.shape[1]} or fix the input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training mode on several ranks, with the job's batch statistics."""
        self._check_input_dim(input)
        if not self.training or size() == 1:
            return super().forward(input)
        momentum = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, *running, self.eps, momentum)


def _channel_view(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-channel ``values`` shaped to broadcast against a ``dim``-D (N, C, ...) tensor."""
    return values.view(1, -1, *([1] * (dim - 2)))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: normalize with statistics gathered from all ranks. Backward: reduce sum_dy, sum_dy_xmu."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        x = input.to(_compute_dtype(input.dtype)).contiguous()
        channels, dim = x.shape[1], x.dim()
        axes = [0, *range(2, dim)]
        count = x.numel() // channels
        local_mean = x.sum(axes) / max(count, 1)
        local_m2 = (x - _channel_view(local_mean, dim)).square().sum(axes)
        mine = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                          local_mean.double(), local_m2.double()])
        gathered = allgather(mine.unsqueeze(0))  # one row per rank: count, C means, C m2s
        counts, means, m2s = gathered[:, :1], gathered[:, 1:1 + channels], gathered[:, 1 + channels:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel in training mode, got "
                             f"{int(total)} over all ranks (input shape {tuple(input.shape)} on this "
                             f"rank); use larger batches or call .eval()")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean).square()).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
            running_var.mul_(1 - momentum).add_((m2 / (total - 1) * momentum).to(running_var.dtype))

        mean, invstd = mean.to(x.dtype), invstd.to(x.dtype)
        output = (x - _channel_view(mean, dim)) * _channel_view(invstd, dim)
        if weight is not None:
            output = output * _channel_view(weight.to(x.dtype), dim)
        if bias is not None:
            output = output + _channel_view(bias.to(x.dtype), dim)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = float(total)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        dim = x.dim()
        axes = [0, *range(2, dim)]
        dy = grad_output.to(x.dtype)
        xmu = x - _channel_view(mean, dim)
        sum_dy = dy.sum(axes)
        sum_dy_xmu = (dy * xmu).sum(axes)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            channels = sum_dy.numel()
            job_sums = allreduce(torch.cat([sum_dy, sum_dy_xmu]), op=Sum)
            mean_dy = job_sums[:channels] / ctx.total
            mean_dy_xmu = job_sums[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(x.dtype)
            grad_input = (dy - _channel_view(mean_dy, dim)
                          - xmu * _channel_view(invstd.square() * mean_dy_xmu, dim)) * _channel_view(scale, dim)
            grad_input = grad_input.to(grad_output.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
