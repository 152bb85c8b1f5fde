"""Sample-level DP-SGD for one client's local training (run config ``dp = "dp-sgd"``).

Each logical batch is drawn by Poisson sampling (every local example joins with probability
``q = logical_batch / N``), every per-sample gradient is clipped to L2 norm ``max-grad-norm``,
the clipped gradients are summed, Gaussian noise of standard deviation
``noise-multiplier * max-grad-norm`` is added, and the sum is divided by the expected batch
size before an ordinary SGD (+ momentum) step (Abadi et al. 2016, "Deep Learning with
Differential Privacy", CCS). Logical batches larger than ``batch-size`` are processed in
micro-batches of at most ``batch-size`` samples with Opacus' ``BatchMemoryManager``; clipping
is per sample, so this changes memory use, not the result.

The privacy loss of the whole run is tracked by one accountant per client whose history
``[(noise_multiplier, sample_rate, steps), ...]`` is carried between rounds as plain lists
(`fedcomp.privacy.accountant_state` / `fedcomp.privacy.restore_accountant`), so
epsilon keeps growing over the rounds instead of restarting at every round. The settings
(`fedcomp.privacy.DPSGDConfig`), the accounting and the noise calibration live in
`fedcomp.privacy`; this module holds the Opacus training only.

This module knows nothing about Flower. The guarantee is per example of this client's
partition (sample-level DP), with respect to everything the client sends afterwards
(post-processing: compression, error feedback). It assumes Poisson sampling, which this module
always uses, and a PRNG that is not adversarially predictable (see ``secure-rng``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fedcomp.privacy.opacus_import import import_opacus

import_opacus()  # before any `from opacus ...`: keeps Opacus' logging.basicConfig from doubling every log line
from opacus import PrivacyEngine
from opacus.accountants import IAccountant
from opacus.data_loader import wrap_collate_with_empty
from opacus.grad_sample import AbstractGradSampleModule
from opacus.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS
from opacus.optimizers import DPOptimizer
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from fedcomp.privacy import (
    DPSGDConfig,
    accounting,
    epsilon_spent,
    logical_batch_size,
    resolve_noise_multiplier,
    restore_accountant,
    sample_rate,
    steps_per_epoch,
)

# ---------------------------------------------------------------------------------------------
# Making a model private
# ---------------------------------------------------------------------------------------------

def _plain_module(model: nn.Module) -> nn.Module:
    """The user's module without any Opacus wrapper."""
    while isinstance(model, AbstractGradSampleModule):
        model = model._module
    return model


def _strip_opacus(work: nn.Module, original: nn.Module) -> None:
    """Remove what an Opacus ``GradSampleModule`` left on ``original`` from its deep copy
    ``work``: the per-sample-gradient hooks (matched by handle id), the handle list, the
    functorch helpers and the per-parameter attributes (``grad_sample``, ...)."""
    handles = getattr(original, "autograd_grad_sample_hooks", None)
    if handles is not None:
        ids = {h.id for h in handles}
        for sub in work.modules():
            for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                         "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                hooks = getattr(sub, attr, None)
                if hooks is not None:
                    for i in ids:
                        hooks.pop(i, None)
        if hasattr(work, "autograd_grad_sample_hooks"):
            delattr(work, "autograd_grad_sample_hooks")
    for sub in work.modules():
        if hasattr(sub, "ft_compute_sample_grad"):
            delattr(sub, "ft_compute_sample_grad")
    for p in work.parameters():
        for attr in OPACUS_PARAM_MONKEYPATCH_ATTRS + ["summed_grad"]:
            if hasattr(p, attr):
                delattr(p, attr)


def _disable_inplace(module: nn.Module) -> int:
    """Set ``inplace = False`` on every submodule that has that flag (ReLU, LeakyReLU, ELU,
    Hardtanh, Dropout, ...). In-place ops on a layer's output break the full backward hooks
    that compute per-sample gradients. Returns how many were changed."""
    changed = 0
    for sub in module.modules():
        if getattr(sub, "inplace", False) is True:
            sub.inplace = False
            changed += 1
    return changed


def dp_compatible_copy(model: nn.Module) -> tuple[nn.Module, bool]:
    """A fresh, DP-compatible training copy of ``model`` (the caller's module is not touched).

    Unwraps an Opacus ``GradSampleModule`` if given one (never wraps twice), copies the plain
    module, replaces in-place activations, runs ``ModuleValidator.fix`` when validation
    fails (e.g. BatchNorm -> GroupNorm) and validates strictly.

    Returns
    -------
    (module, replaced)
        The copy in training mode, and whether ``fix`` replaced any submodule (the trained
        architecture then differs from the caller's).

    Raises
    ------
    ValueError
        The module cannot be made compatible (Opacus' ``UnsupportedModuleError`` is a
        ``ValueError``).
    """
    plain = _plain_module(model)
    work = copy.deepcopy(plain).train()
    _strip_opacus(work, plain)
    _disable_inplace(work)
    replaced = False
    batchnorm = [e for e in ModuleValidator.validate(work, strict=False) if "BatchNorm" in str(e)]
    if batchnorm:  # fix() would train GroupNorm but evaluate BatchNorm with running statistics never updated
        raise ValueError(f"DP-SGD cannot train this model as it is: {batchnorm[0]} (choose a model without "
                         "BatchNorm, e.g. model = 'cnn', or another dp mode)")
    if not ModuleValidator.is_valid(work):
        work = ModuleValidator.fix(work).train()
        replaced = True
    ModuleValidator.validate(work, strict=True)
    _check_parameters_match(work, plain)
    return work, replaced


def _check_parameters_match(trained: nn.Module, target: nn.Module) -> None:
    """Every parameter of ``target`` must exist in ``trained`` under the same name and shape,
    so the trained weights can go back under the original names."""
    src = dict(trained.named_parameters())
    for name, p in target.named_parameters():
        if name not in src or src[name].shape != p.shape:
            raise ValueError(
                f"the DP-compatible copy of the model has no parameter {name!r} of shape "
                f"{tuple(p.shape)} (ModuleValidator.fix changed the architecture); build the model "
                "DP-compatible instead (e.g. GroupNorm instead of BatchNorm, DPLSTM instead of LSTM)"
            )


def _copy_back(trained: nn.Module, target: nn.Module) -> None:
    """Copy ``trained``'s parameters and same-named, same-shaped buffers into ``target``."""
    _check_parameters_match(trained, target)
    src, dst = trained.state_dict(), target.state_dict()
    update = {k: v for k, v in src.items() if k in dst and v.shape == dst[k].shape}
    target.load_state_dict(update, strict=False)


def poisson_loader(dataset: Dataset, rate: float, steps: int, generator: torch.Generator | None) -> DataLoader:
    """Data loader yielding ``steps`` logical batches per pass, each including every example
    independently with probability ``rate`` (Poisson sampling); empty batches come out as
    zero-length tensors so the step (noise only) still happens and is accounted for."""
    first = dataset[0]
    sampler = UniformWithReplacementSampler(
        num_samples=len(dataset), sample_rate=rate, generator=generator, steps=steps
    )
    collate = wrap_collate_with_empty(
        collate_fn=default_collate,
        sample_empty_shapes=[(0, *getattr(x, "shape", ())) for x in first],
        dtypes=[getattr(x, "dtype", type(x)) for x in first],
    )
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, generator=generator)


@dataclass
class PrivateTraining:
    """What `make_private` built for one round.

    Attributes
    ----------
    module : opacus.grad_sample.AbstractGradSampleModule
        Wrapper computing per-sample gradients of a private copy of the model.
    optimizer : opacus.optimizers.DPOptimizer
        Clips, sums, noises and scales; its step hook feeds ``accountant``.
    data_loader : DataLoader
        Poisson-sampled logical batches (expected size ``expected_batch_size``).
    accountant : IAccountant
        The run's accountant, restored from state, advanced by every logical step.
    sample_rate : float
        q recorded per step.
    noise_multiplier : float
        sigma in use.
    expected_batch_size : int
        ``q * N``: the divisor of the noisy gradient sum (Abadi et al. 2016, Alg. 1).
    replaced_modules : bool
        Whether ``ModuleValidator.fix`` changed the architecture.
    """

    module: AbstractGradSampleModule
    optimizer: DPOptimizer
    data_loader: DataLoader
    accountant: IAccountant
    sample_rate: float
    noise_multiplier: float
    expected_batch_size: int
    replaced_modules: bool


def make_private(
    model: nn.Module,
    dataset: Dataset,
    dp_cfg: DPSGDConfig,
    device: torch.device,
    *,
    lr: float,
    logical_batch: int,
    local_epochs: int,
    momentum: float = 0.0,
    seed: int = 0,
    accountant_state: Mapping[str, Any] | None = None,
) -> PrivateTraining:
    """Build the private training objects for one round from a fresh copy of ``model``.

    A new ``PrivacyEngine`` is created per round, but its accountant is the run's
    accountant restored from ``accountant_state``. Its ``make_private`` wraps the copy and
    the SGD optimizer (``lr``, ``momentum``); the Poisson loader is built
    here with ``q = logical_batch / N`` exactly (``make_private``'s own loader would use
    ``1 / ceil(N / logical_batch)``), and the accounting hook and the optimizer's expected
    batch size are set to that same q.

    Parameters
    ----------
    model : nn.Module
        The caller's plain model (or an Opacus wrapper of it); not modified.
    dataset : Dataset
        Map-style dataset of ``(x, y)`` pairs, N = ``len(dataset)`` >= 1.
    dp_cfg : DPSGDConfig
    device : torch.device
    lr : float
        SGD learning rate, > 0.
    logical_batch : int
        Expected examples per optimizer step (``batch_size * accumulation_steps``), >= 1.
    local_epochs : int
        Passes over the local data per round, >= 1 (with ``target_epsilon``, the calibration plans
        for them).
    momentum : float
        SGD momentum, in [0, 1).
    seed : int
        Seeds the Poisson sampler and (without secure RNG) the noise generator.
    accountant_state : mapping or None
        From `accountant_state` after the previous round; None on the first.

    Raises
    ------
    ValueError
        Empty dataset, an incompatible model, a bad accountant state, an unreachable target
        epsilon.
    """
    n = len(dataset)
    if n < 1:
        raise ValueError("DP-SGD needs at least one local example")
    logical = int(logical_batch)
    q = sample_rate(n, logical)
    sigma = resolve_noise_multiplier(dp_cfg, n, logical_batch=logical, local_epochs=local_epochs)
    accountant = restore_accountant(dp_cfg.accountant, accountant_state)
    work, replaced = dp_compatible_copy(model)
    work.to(device)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant=dp_cfg.accountant, secure_mode=dp_cfg.secure_rng)
    engine.accountant = accountant
    if dp_cfg.secure_rng:
        sample_gen, noise_gen = engine.secure_rng, None
    else:
        sample_gen = torch.Generator().manual_seed(int(seed))
        noise_gen = torch.Generator(device=device).manual_seed(int(seed) + 0x5EED)
    loader = poisson_loader(dataset, q, steps_per_epoch(n, logical), sample_gen)
    optimizer = torch.optim.SGD(work.parameters(), lr=lr, momentum=momentum)
    gsm, dp_opt, loader = engine.make_private(
        module=work, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=dp_cfg.max_grad_norm, poisson_sampling=False, noise_generator=noise_gen,
    )
    gsm.forbid_grad_accumulation()
    expected = round(q * n)
    dp_opt.expected_batch_size = expected
    dp_opt.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=q))
    return PrivateTraining(gsm, dp_opt, loader, accountant, q, sigma, expected, replaced)


def run_epochs(private: PrivateTraining, epochs: int, physical_batch_size: int, device: torch.device) -> float:
    """Train ``epochs`` passes of Poisson-sampled logical batches, micro-batched.

    Each micro-batch's mean cross-entropy is back-propagated as is (not divided by the
    number of micro-batches): per-sample gradients are what get clipped and summed, and the
    optimizer divides the noisy sum by the expected logical batch size once per step.

    Returns
    -------
    float
        Mean cross-entropy per sample over all non-empty micro-batches (0.0 if none).
    """
    private.module.train()
    loss_fn = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        # Inputs do not require grad, so torch notes that the per-sample-gradient backward
        # hooks fire on module outputs: that is what Opacus relies on.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        total, seen = _epochs(private, epochs, physical_batch_size, device, loss_fn)
    private.optimizer.zero_grad(set_to_none=True)
    return total / seen if seen else 0.0


def _epochs(private: PrivateTraining, epochs: int, physical_batch_size: int, device: torch.device,
            loss_fn: nn.Module) -> tuple[float, int]:
    model, opt = private.module, private.optimizer
    total, seen = 0.0, 0
    for _ in range(epochs):
        with BatchMemoryManager(
            data_loader=private.data_loader, max_physical_batch_size=physical_batch_size, optimizer=opt
        ) as loader:
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()  # empty batch: NaN loss, but zero-length per-sample grads
                opt.step()        # clips+sums; at the end of a logical batch noises, steps
                if len(y):
                    total += float(loss.detach()) * len(y)
                    seen += len(y)
    return total, seen


class DPTrainResult(NamedTuple):
    """What `train_dp_sgd` returns (unpacks as a 4-tuple)."""

    mean_loss: float
    num_examples: int
    epsilon: float
    accountant_state: dict[str, list[float]]


def train_dp_sgd(
    model: nn.Module,
    dataset: Dataset,
    dp_cfg: DPSGDConfig,
    device: torch.device,
    *,
    lr: float,
    batch_size: int,
    local_epochs: int,
    accumulation_steps: int = 1,
    momentum: float = 0.0,
    seed: int = 0,
    accountant_state: Mapping[str, Any] | None = None,
) -> DPTrainResult:
    """One round of sample-level DP-SGD on this client; ``model`` is updated in place.

    Trains a private copy (see `make_private`) for ``local_epochs`` epochs of
    ``ceil(N / logical_batch)`` Poisson-sampled logical batches (expected size
    ``batch_size * accumulation_steps``; micro-batches of at most ``batch_size``), then copies
    the trained weights back into ``model`` under its original parameter names (no
    ``_module.`` prefix). ``model`` itself is never wrapped or hooked, so calling this every
    round on the same model is safe.

    Parameters
    ----------
    model : nn.Module
        Plain model, weights = the received global model. Updated in place.
    dataset : Dataset
        Local training data, ``(x, y)`` pairs, N >= 1.
    dp_cfg : DPSGDConfig
    device : torch.device
    lr : float
        SGD learning rate, > 0.
    batch_size : int
        Physical micro-batch size, >= 1.
    local_epochs : int
        Passes over the local data, >= 1.
    accumulation_steps : int
        Micro-batches per logical batch, >= 1: the expected logical batch is
        ``batch_size * accumulation_steps``.
    momentum : float
        SGD momentum, in [0, 1).
    seed : int
        Seeds Poisson sampling and noise (vary it per round; see ``secure_rng``).
    accountant_state : mapping or None
        The previous round's returned state, None in the first round.

    Returns
    -------
    DPTrainResult
        ``(mean_loss, num_examples, epsilon, accountant_state)``: mean cross-entropy per sampled
        example (nats), ``len(dataset)`` (the FedAvg weight, as plain training reports), the
        run's epsilon so far at ``dp_cfg.target_delta`` (``inf`` with noise multiplier 0),
        and the new state to keep for the next round.

    Raises
    ------
    ValueError
        See `make_private`.

    Notes
    -----
    Abadi et al. 2016 (Alg. 1, moments accountant); Mironov 2017 (RDP); Opacus 1.6
    (``PrivacyEngine``, ``DPOptimizer``, ``BatchMemoryManager``).
    """
    private = make_private(model, dataset, dp_cfg, device, lr=lr, momentum=momentum,
                           logical_batch=logical_batch_size(batch_size, accumulation_steps),
                           local_epochs=local_epochs, seed=seed, accountant_state=accountant_state)
    loss = run_epochs(private, int(local_epochs), int(batch_size), device)
    trained = private.module._module
    private.module._close()  # remove hooks and per-sample attributes from the copy
    if private.replaced_modules:
        warnings.warn(
            "ModuleValidator.fix replaced submodules (e.g. BatchNorm -> GroupNorm) for DP-SGD; "
            "the weights copied back into the original architecture are not equivalent. Build "
            "the model DP-compatible.", RuntimeWarning, stacklevel=2,
        )
    _copy_back(trained, _plain_module(model))
    eps = epsilon_spent(private.accountant, dp_cfg.target_delta)
    return DPTrainResult(float(loss), len(dataset), eps, accounting.accountant_state(private.accountant))
