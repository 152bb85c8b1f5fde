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
(:func:`accountant_state` / :func:`restore_accountant`), so epsilon keeps growing over the
rounds instead of restarting at every round. "rdp" is the Renyi-DP accountant (Mironov 2017,
"Renyi Differential Privacy", CSF; subsampled Gaussian bound of Mironov, Talwar & Zhang 2019);
"prv" is the numerical PRV accountant (Gopi, Lee & Wutschitz 2021). Both are Opacus 1.6's.

This module knows nothing about Flower. The guarantee is per example of this client's
partition (sample-level DP), with respect to everything the client sends afterwards
(post-processing: compression, error feedback). It assumes Poisson sampling, which this module
always uses, and a PRNG that is not adversarially predictable (see ``secure-rng``).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from .._opacus import import_opacus

import_opacus()  # before any `from opacus ...`: keeps Opacus' logging.basicConfig from doubling every log line
from opacus import PrivacyEngine
from opacus.accountants import IAccountant, RDPAccountant, create_accountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.utils import get_noise_multiplier
from opacus.data_loader import wrap_collate_with_empty
from opacus.grad_sample import AbstractGradSampleModule
from opacus.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS
from opacus.optimizers import DPOptimizer
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from ..privacy import epsilon_from_rdp
from .training import TrainConfig

#: Accountants this module accepts (run config ``accountant``).
ACCOUNTANTS = ("rdp", "prv")
#: Keys of the plain-data accountant state: parallel lists of floats, one entry per
#: (noise multiplier, sample rate) segment of the history.
STATE_KEYS = ("noise-multiplier", "sample-rate", "steps")

_DEFAULTS: dict[str, Any] = {
    "noise-multiplier": 1.0,
    "max-grad-norm": 1.0,
    "target-delta": 1e-5,
    "accountant": "rdp",
    "secure-rng": False,
    "num-server-rounds": 50,
}


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

def _number(cfg: Mapping[str, Any], key: str, default: Any) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"run config '{key}' must be a number, got {value!r}")
    return float(value)


def _secure_rng_available() -> bool:
    try:
        import torchcsprng  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class DPSGDConfig:
    """DP-SGD parameters (run config keys in brackets); validated on construction.

    Attributes
    ----------
    noise_multiplier : float
        sigma [``noise-multiplier``], >= 0: the Gaussian noise added to each summed logical
        batch gradient has standard deviation ``sigma * max_grad_norm``. 0 means no privacy
        (epsilon is reported as ``inf``). Default 1.0, a common starting point (Opacus
        examples) that keeps accuracy within a few points on small CNNs. Ignored when
        ``target_epsilon`` is set.
    max_grad_norm : float
        C [``max-grad-norm``], > 0: L2 bound each per-sample gradient is clipped to (flat
        clipping over all parameters). Default 1.0 (Abadi et al. 2016 use 4; smaller C clips
        more and needs less absolute noise).
    target_delta : float
        delta [``target-delta``], in (0, 1): the delta at which epsilon is reported. Default
        1e-5; it should be well below ``1 / N`` (N = local examples).
    target_epsilon : float or None
        [``target-epsilon``], > 0, optional. When set, sigma is calibrated once so that the
        whole planned run (``planned_rounds`` rounds x ``local_epochs`` x steps per epoch,
        assuming the client trains in every round) ends at this epsilon; ``noise_multiplier``
        is then ignored. A client that trains in fewer rounds ends below it; one that trains
        in more rounds ends above it (the reported epsilon says so).
    planned_rounds : int
        Rounds the calibration plans for [``num-server-rounds``], >= 1. Default 50, as the
        app config's default.
    accountant : {"rdp", "prv"}
        [``accountant``]. "rdp" (default): Renyi DP (Mironov 2017), fast and slightly loose.
        "prv": numerical composition of privacy loss random variables (Gopi et al. 2021),
        tighter (smaller epsilon for the same noise) but ~0.1-1 s per epsilon query.
    secure_rng : bool
        [``secure-rng``]. True would draw noise and Poisson samples from a cryptographically
        secure generator (Opacus ``secure_mode``, which needs the ``torchcsprng`` package).
        Default False: seeded ``torch.Generator`` draws, reproducible and fine for
        experiments, but not a guarantee against an adversary who can predict the PRNG.

    Raises
    ------
    ValueError
        Naming the run-config key: delta outside (0, 1), max-grad-norm <= 0, noise-multiplier
        < 0, target-epsilon <= 0 or below what any amount of noise reaches at this delta, an
        unknown accountant, num-server-rounds < 1, or secure-rng = true where torchcsprng is
        not installed.
    """

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    target_delta: float = 1e-5
    target_epsilon: float | None = None
    planned_rounds: int = 50
    accountant: str = "rdp"
    secure_rng: bool = False

    def __post_init__(self) -> None:
        if not self.noise_multiplier >= 0 or math.isinf(self.noise_multiplier):
            raise ValueError(f"run config 'noise-multiplier' must be a finite number >= 0, got {self.noise_multiplier!r}")
        if not self.max_grad_norm > 0 or math.isinf(self.max_grad_norm):
            raise ValueError(f"run config 'max-grad-norm' must be in (0, inf), got {self.max_grad_norm!r}")
        if not 0.0 < self.target_delta < 1.0:
            raise ValueError(f"run config 'target-delta' must be in (0, 1), got {self.target_delta!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"run config 'accountant' must be one of {list(ACCOUNTANTS)}, got {self.accountant!r}")
        if isinstance(self.planned_rounds, bool) or not isinstance(self.planned_rounds, int) or self.planned_rounds < 1:
            raise ValueError(f"run config 'num-server-rounds' must be an integer >= 1, got {self.planned_rounds!r}")
        if not isinstance(self.secure_rng, bool):
            raise ValueError(f"run config 'secure-rng' must be true or false, got {self.secure_rng!r}")
        if self.secure_rng and not _secure_rng_available():
            raise ValueError(
                "run config 'secure-rng' = true needs Opacus' secure mode, which draws noise and "
                "Poisson samples from torchcsprng's cryptographically secure generator; the "
                "torchcsprng package is not installed here (it has no build for this PyTorch). "
                "Set secure-rng = false (seeded torch.Generator: fine for experiments, not for a "
                "production guarantee) or install torchcsprng on every client."
            )
        if self.target_epsilon is not None:
            if not self.target_epsilon > 0 or math.isinf(self.target_epsilon):
                raise ValueError(f"run config 'target-epsilon' must be in (0, inf), got {self.target_epsilon!r}")
            # The smallest epsilon any noise reaches is set by delta and the accountant, not
            # by the sample rate or the number of steps (the privacy loss of the mechanism
            # vanishes as sigma grows; what remains is the conversion to (epsilon, delta)).
            # One fully-sampled step is therefore a representative feasibility check.
            calibrate_noise_multiplier(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                sample_rate=1.0, steps=1, accountant=self.accountant,
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> DPSGDConfig:
        """Parse and validate the DP-SGD keys of a run config (``context.run_config``).

        Reads ``noise-multiplier``, ``max-grad-norm``, ``target-delta``, ``target-epsilon``
        (absent = no calibration), ``accountant``, ``secure-rng`` and, with
        ``target-epsilon``, ``num-server-rounds``. Other keys are ignored.

        Raises
        ------
        ValueError
            A key with a wrong type or out of range (see the class docstring).
        """
        secure = cfg.get("secure-rng", _DEFAULTS["secure-rng"])
        if not isinstance(secure, bool):
            raise ValueError(f"run config 'secure-rng' must be true or false, got {secure!r}")
        accountant = cfg.get("accountant", _DEFAULTS["accountant"])
        if not isinstance(accountant, str):
            raise ValueError(f"run config 'accountant' must be a string, got {accountant!r}")
        target = cfg.get("target-epsilon")
        if target == 0:  # the app's run config uses 0 for "not set" (every key needs a default)
            target = None
        rounds = cfg.get("num-server-rounds", _DEFAULTS["num-server-rounds"])
        if isinstance(rounds, float) and rounds.is_integer():
            rounds = int(rounds)
        return cls(
            noise_multiplier=_number(cfg, "noise-multiplier", _DEFAULTS["noise-multiplier"]),
            max_grad_norm=_number(cfg, "max-grad-norm", _DEFAULTS["max-grad-norm"]),
            target_delta=_number(cfg, "target-delta", _DEFAULTS["target-delta"]),
            target_epsilon=None if target is None else _number(cfg, "target-epsilon", None),
            planned_rounds=rounds,
            accountant=accountant,
            secure_rng=secure,
        )


# ---------------------------------------------------------------------------------------------
# Sampling arithmetic and noise calibration
# ---------------------------------------------------------------------------------------------

def logical_batch_size(train_cfg: TrainConfig) -> int:
    """Logical (expected) batch size ``batch_size * accumulation_steps``, in samples."""
    return int(train_cfg.batch_size) * int(train_cfg.accumulation_steps)


def sample_rate(num_examples: int, logical_batch: int) -> float:
    """Poisson sampling probability ``q = min(1, logical_batch / num_examples)``.

    Raises
    ------
    ValueError
        ``num_examples < 1`` or ``logical_batch < 1``.
    """
    if num_examples < 1 or logical_batch < 1:
        raise ValueError(f"need num_examples >= 1 and logical_batch >= 1, got {num_examples}, {logical_batch}")
    return min(1.0, logical_batch / num_examples)


def steps_per_epoch(num_examples: int, logical_batch: int) -> int:
    """Optimizer steps per local epoch, ``ceil(num_examples / logical_batch)`` (>= 1).

    The same number of steps as the plain loop's ``len(DataLoader)``, so one epoch visits
    ``num_examples`` samples in expectation when ``logical_batch`` divides it.
    """
    sample_rate(num_examples, logical_batch)  # validates
    return max(1, math.ceil(num_examples / logical_batch))


@lru_cache(maxsize=64)
def calibrate_noise_multiplier(
    *, target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """Smallest noise multiplier (up to the search tolerance) whose epsilon after ``steps``
    Poisson-subsampled Gaussian steps at rate ``sample_rate`` is at most ``target_epsilon``.

    Bisection over sigma with Opacus' ``get_noise_multiplier``; the tolerance is 0.5 % of
    the target, so the returned sigma spends between 99.5 % and 100 % of the budget.
    Results are cached (the inputs are the same every round).

    Parameters
    ----------
    target_epsilon : float
        Budget, > 0.
    target_delta : float
        In (0, 1).
    sample_rate : float
        q in (0, 1].
    steps : int
        Planned optimizer steps of the whole run, >= 1.
    accountant : {"rdp", "prv"}

    Returns
    -------
    float
        sigma (dimensionless: noise std / max_grad_norm).

    Raises
    ------
    ValueError
        Naming ``target-epsilon`` when no sigma up to 1e6 reaches the target (for "rdp" at
        delta = 1e-5, targets below ~0.12 are out of reach whatever the noise).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # PRV's log(0) branches
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")  # probes
            return float(get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate,
                steps=steps, accountant=accountant, epsilon_tolerance=0.005 * target_epsilon,
            ))
    except ValueError as exc:
        raise ValueError(
            f"run config 'target-epsilon' = {target_epsilon} is not reachable at target-delta = "
            f"{target_delta} with the {accountant!r} accountant (no noise multiplier up to 1e6 "
            f"gets there: {exc}); raise target-epsilon or target-delta"
        ) from None


def planned_steps(dp_cfg: DPSGDConfig, train_cfg: TrainConfig, num_examples: int) -> int:
    """Optimizer steps of the whole planned run on this client:
    ``planned_rounds * local_epochs * steps_per_epoch``."""
    per_epoch = steps_per_epoch(num_examples, logical_batch_size(train_cfg))
    return dp_cfg.planned_rounds * int(train_cfg.local_epochs) * per_epoch


def resolve_noise_multiplier(dp_cfg: DPSGDConfig, train_cfg: TrainConfig, num_examples: int) -> float:
    """The sigma this client uses: ``dp_cfg.noise_multiplier``, or with ``target_epsilon``
    the calibrated one for :func:`planned_steps` at this client's sample rate.

    Raises
    ------
    ValueError
        Unreachable target epsilon (naming ``target-epsilon``).
    """
    if dp_cfg.target_epsilon is None:
        return float(dp_cfg.noise_multiplier)
    q = sample_rate(num_examples, logical_batch_size(train_cfg))
    return calibrate_noise_multiplier(
        target_epsilon=float(dp_cfg.target_epsilon), target_delta=float(dp_cfg.target_delta),
        sample_rate=q, steps=planned_steps(dp_cfg, train_cfg, num_examples), accountant=dp_cfg.accountant,
    )


# ---------------------------------------------------------------------------------------------
# Accountant state (plain data, survives between rounds)
# ---------------------------------------------------------------------------------------------

def new_accountant(kind: str = "rdp") -> IAccountant:
    """An empty Opacus accountant, ``kind`` in :data:`ACCOUNTANTS`.

    Raises
    ------
    ValueError
        Unknown kind (naming ``accountant``).
    """
    if kind not in ACCOUNTANTS:
        raise ValueError(f"run config 'accountant' must be one of {list(ACCOUNTANTS)}, got {kind!r}")
    return create_accountant(mechanism=kind)


def accountant_state(accountant: IAccountant) -> dict[str, list[float]]:
    """The accountant's history as parallel lists of Python floats.

    Returns
    -------
    dict
        ``{"noise-multiplier": [sigma_i], "sample-rate": [q_i], "steps": [T_i]}``, one entry
        per segment of consecutive steps with the same (sigma, q); ``T_i`` are whole numbers
        stored as floats. Valid as a Flower ``MetricRecord``; empty lists for no steps.
        The same format serves "rdp" and "prv" (both keep this history).
    """
    sigmas, rates, steps = [], [], []
    for sigma, q, t in accountant.history:
        sigmas.append(float(sigma))
        rates.append(float(q))
        steps.append(float(t))
    return {"noise-multiplier": sigmas, "sample-rate": rates, "steps": steps}


#: Alias used where a parameter named ``accountant_state`` shadows the function.
accountant_state_of = accountant_state


def restore_accountant(kind: str, state: Mapping[str, Any] | None) -> IAccountant:
    """An accountant of ``kind`` whose history is ``state`` (from :func:`accountant_state`).

    Parameters
    ----------
    kind : {"rdp", "prv"}
    state : mapping or None
        None or an empty mapping gives an empty accountant (first round).

    Raises
    ------
    ValueError
        Missing keys, lists of different lengths, sigma < 0, q outside (0, 1], or steps that
        are not whole numbers >= 1.
    """
    acc = new_accountant(kind)
    if not state:
        return acc
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"accountant state lacks {missing}; expected keys {list(STATE_KEYS)}")
    sigmas, rates, steps = (list(state[k]) for k in STATE_KEYS)
    if not len(sigmas) == len(rates) == len(steps):
        raise ValueError(f"accountant state lists differ in length: {len(sigmas)}, {len(rates)}, {len(steps)}")
    history = []
    for sigma, q, t in zip(sigmas, rates, steps):
        sigma, q, t = float(sigma), float(q), float(t)
        if not sigma >= 0 or not 0 < q <= 1 or not t >= 1 or not t.is_integer():
            raise ValueError(f"invalid accountant state entry (noise-multiplier={sigma}, sample-rate={q}, steps={t})")
        history.append((sigma, q, int(t)))
    acc.history = history
    return acc


def epsilon_spent(accountant: IAccountant, delta: float) -> float:
    """Epsilon of everything the accountant recorded, at ``delta``.

    0.0 for an empty history; ``float('inf')`` ("no privacy") as soon as any step used
    noise multiplier 0; otherwise the accountant's bound (RDP: Mironov 2017 with Opacus'
    conversion; PRV: the upper bound of Gopi et al. 2021), floored at 0 as explained in
    :func:`fedcomp.privacy.epsilon_from_rdp` (finite, >= 0, non-decreasing over rounds).
    """
    if not accountant.history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in accountant.history):
        return float("inf")
    if accountant.mechanism() == "rdp":
        # Same arithmetic as RDPAccountant.get_epsilon, with the per-step RDP curve cached:
        # it depends only on (q, sigma), which stay fixed over a run, and costs ~0.3 s.
        rdp = sum(t * _rdp_one_step(q, sigma) for sigma, q, t in accountant.history)
        return epsilon_from_rdp(RDPAccountant.DEFAULT_ALPHAS, rdp, delta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # PRV's numerical bound also dips below 0 at large delta; (eps < 0, delta) implies (0, delta)
        return max(0.0, float(accountant.get_epsilon(delta=delta)))


@lru_cache(maxsize=256)
def _rdp_one_step(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at each of Opacus' default orders
    (Mironov, Talwar & Zhang 2019), shape ``(len(RDPAccountant.DEFAULT_ALPHAS),)``."""
    rdp = rdp_analysis.compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS
    )
    rdp = np.asarray(rdp, dtype=np.float64)
    rdp.flags.writeable = False
    return rdp


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
    """What :func:`make_private` built for one round.

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
    train_cfg: TrainConfig,
    dp_cfg: DPSGDConfig,
    device: torch.device,
    seed: int = 0,
    accountant_state: Mapping[str, Any] | None = None,
) -> PrivateTraining:
    """Build the private training objects for one round from a fresh copy of ``model``.

    A new ``PrivacyEngine`` is created per round, but its accountant is the run's
    accountant restored from ``accountant_state``. Its ``make_private`` wraps the copy and
    the SGD optimizer (``lr``, ``momentum`` from ``train_cfg``); the Poisson loader is built
    here with ``q = logical_batch / N`` exactly (``make_private``'s own loader would use
    ``1 / ceil(N / logical_batch)``), and the accounting hook and the optimizer's expected
    batch size are set to that same q.

    Parameters
    ----------
    model : nn.Module
        The caller's plain model (or an Opacus wrapper of it); not modified.
    dataset : Dataset
        Map-style dataset of ``(x, y)`` pairs, N = ``len(dataset)`` >= 1.
    train_cfg, dp_cfg : TrainConfig, DPSGDConfig
    device : torch.device
    seed : int
        Seeds the Poisson sampler and (without secure RNG) the noise generator.
    accountant_state : mapping or None
        From :func:`accountant_state` after the previous round; None on the first.

    Raises
    ------
    ValueError
        Empty dataset, an incompatible model, a bad accountant state, an unreachable target
        epsilon.
    """
    n = len(dataset)
    if n < 1:
        raise ValueError("DP-SGD needs at least one local example")
    logical = logical_batch_size(train_cfg)
    q = sample_rate(n, logical)
    sigma = resolve_noise_multiplier(dp_cfg, train_cfg, n)
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
    optimizer = torch.optim.SGD(work.parameters(), lr=train_cfg.lr, momentum=train_cfg.momentum)
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
    """What :func:`train_dp_sgd` returns (unpacks as a 4-tuple)."""

    mean_loss: float
    num_examples: int
    epsilon: float
    accountant_state: dict[str, list[float]]


def train_dp_sgd(
    model: nn.Module,
    dataset: Dataset,
    train_cfg: TrainConfig,
    dp_cfg: DPSGDConfig,
    device: torch.device,
    seed: int = 0,
    accountant_state: Mapping[str, Any] | None = None,
) -> DPTrainResult:
    """One round of sample-level DP-SGD on this client; ``model`` is updated in place.

    Trains a private copy (see :func:`make_private`) for ``train_cfg.local_epochs`` epochs of
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
    train_cfg : TrainConfig
        ``local_epochs``, ``batch_size`` (physical), ``accumulation_steps``, ``lr``, ``momentum``.
    dp_cfg : DPSGDConfig
    device : torch.device
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
        See :func:`make_private`.

    Notes
    -----
    Abadi et al. 2016 (Alg. 1, moments accountant); Mironov 2017 (RDP); Opacus 1.6
    (``PrivacyEngine``, ``DPOptimizer``, ``BatchMemoryManager``).
    """
    private = make_private(model, dataset, train_cfg, dp_cfg, device, seed, accountant_state)
    loss = run_epochs(private, int(train_cfg.local_epochs), int(train_cfg.batch_size), device)
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
    return DPTrainResult(float(loss), len(dataset), eps, accountant_state_of(private.accountant))


def projected_epsilon(dp_cfg: DPSGDConfig, train_cfg: TrainConfig, num_examples: int,
                      accountant_state: Mapping[str, Any] | None) -> float:
    """Epsilon this client would have after one more round (at ``target_delta``), without training.

    Adds this round's steps (``local_epochs * steps_per_epoch`` at this client's sample rate and
    noise multiplier) to a copy of the restored accountant; used to refuse a round that would
    exceed a privacy budget before any data is touched.
    """
    acc = restore_accountant(dp_cfg.accountant, accountant_state)
    sigma = resolve_noise_multiplier(dp_cfg, train_cfg, num_examples)
    q = sample_rate(num_examples, logical_batch_size(train_cfg))
    steps = int(train_cfg.local_epochs) * steps_per_epoch(num_examples, logical_batch_size(train_cfg))
    if sigma == 0:
        return math.inf
    acc.history.append((sigma, q, steps))
    return epsilon_spent(acc, dp_cfg.target_delta)
