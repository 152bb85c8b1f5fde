"""`Download`: the settings of the server-to-client direction, as
``CompressedStrategy(inner, downstream=Download(...))`` takes them, each checked once here.

Source: Sattler et al., "Robust and Communication-Efficient Federated Learning from Non-IID Data",
IEEE TNNLS 2019 (compression in both directions, caching for clients that missed rounds).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from fedcomp.compression import available_compressors
from fedcomp.download.correction import check_correction
from fedcomp.download.first_contact import check_init_policy
from fedcomp.download.seeded_init import SeededInit

#: What clients that missed rounds may get (`Download.catchup`).
CATCHUP_POLICIES = ("smallest", "exact")


@dataclass(frozen=True)
class Download:
    """How the server sends the global model (``CompressedStrategy(downstream=...)``; a string there is
    ``Download(codec=...)``).

    Attributes
    ----------
    codec : str
        ``"auto"`` (default): the library's choice (`fedcomp.strategies.presets.library_downstream`:
        the upload codec's counterpart, ``sign``, STC or int8, with server-side error feedback; dense
        where a compressed download cannot apply);
        ``"none"``: the model dense; or a codec name (`fedcomp.compression.available_compressors`).
        Clients that hold the previous broadcast get ``C(global - broadcast)``; clients that missed
        rounds a catch-up (`catchup`); a client that holds nothing the first contact `init` says.
        Needs ``compression_mod`` on every client.
    density : float or None
        Density of a sparse codec, in (0, 1] (None: the upload's ``density``; with ``codec="auto"``
        and a sparse upload, five times it). Given with ``codec="auto"`` where that picks a codec
        without a density (sign, int8, dense), ``CompressedStrategy`` refuses it.
    init : SeededInit or str
        What a node that holds nothing gets first: ``"auto"`` (a seeded start for LoRA adapters at peft's
        initialisation or a model at PyTorch's default initialisation, else the initial model compressed
        with int8: `fedcomp.download.first_contact.starting_model`), ``"seeded"`` (every float tensor
        drawn from a seed with its mean and variance: models trained from scratch), a codec name (a start
        compressed with it), ``"dense"``, or a `SeededInit` (`fedcomp.download.seeded_init.lora_init`).
    catchup : {"smallest", "exact"}
        Clients that missed rounds get the smaller of the missed payloads and a compressed diff from
        the copy they hold (default), or the missed payloads whenever they exist (every client trains
        from a broadcast version; steadier with sparse codecs such as STC).
    max_copies : float or None
        Most model copies the server keeps for nodes (older versions, per-node copies, payloads), a
        finite number >= 2; past it nodes are forgotten (treated as new) in the order that forgets fewest.
        None (default): 8, or as many as 256 MiB holds when that is more.
    correction : float
        ``c`` in [0, 1]: each client's update is folded as ``delta_i - c (G - H_i)``, ``H_i`` the copy
        of the global model ``G`` it trained from (`fedcomp.download.correction`). Default 0.

    Raises
    ------
    ValueError
        Any setting out of its range, naming it.
    """

    codec: str = "auto"
    density: float | None = None
    init: SeededInit | str = "auto"
    catchup: str = "smallest"
    max_copies: float | None = None
    correction: float = 0.0

    def __post_init__(self) -> None:
        if self.codec not in ("auto", "none") and self.codec not in available_compressors():
            raise ValueError(f"downstream must be 'auto', 'none' or one of {available_compressors()}, "
                             f"got {self.codec!r}")
        object.__setattr__(self, "density", check_density(self.density))
        object.__setattr__(self, "init", check_init_policy("auto" if self.init is None else self.init))
        check_catchup(self.catchup)
        check_max_copies(self.max_copies)
        object.__setattr__(self, "correction", check_correction(self.correction))

    @classmethod
    def of(cls, downstream: Download | str | None) -> Download:
        """``downstream`` as a `Download` (a codec name or None, "none" for None)."""
        if isinstance(downstream, Download):
            return downstream
        if downstream is not None and not isinstance(downstream, str):
            raise ValueError(f"downstream must be a codec name, 'auto', 'none', None or a Download, got {downstream!r}")
        return cls(codec="none" if downstream is None else downstream)

    @property
    def compressed(self) -> bool:
        """Whether the model travels compressed (``codec`` is not "none")."""
        return self.codec != "none"


def check_density(density: float | None) -> float | None:
    """``density`` as a float in (0, 1], or None; ``ValueError`` naming the downstream density otherwise."""
    if density is None:
        return None
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
        raise ValueError(f"downstream density must be in (0, 1], got {density!r}")
    return float(density)


def check_catchup(catchup: str) -> None:
    """``ValueError`` unless ``catchup`` is one of `CATCHUP_POLICIES`."""
    if catchup not in CATCHUP_POLICIES:
        raise ValueError(f"downstream catch-up must be 'smallest' or 'exact', got {catchup!r}")


def check_max_copies(max_copies: float | None) -> None:
    """Refuse a copy budget that is not a finite number >= 2 or None: ``inf`` would let the server's
    memory grow with the number of nodes.

    Raises
    ------
    ValueError
        Naming the copy budget (``max_copies``) and the value.
    """
    if max_copies is not None and (isinstance(max_copies, bool) or not isinstance(max_copies, numbers.Real)
                                   or not 2 <= max_copies < math.inf):
        raise ValueError(f"downstream max_copies must be a finite number >= 2 or None (auto: a bounded budget), "
                         f"got {max_copies!r}")


__all__ = ["CATCHUP_POLICIES", "Download", "check_catchup", "check_density", "check_max_copies"]
