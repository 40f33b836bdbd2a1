"""What a server is started with (the `ditsp serve` flags), checked once: a server that starts can run jobs."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..fixed_shape import SERVE_DETERMINISTIC
from ..memory import check_local_ranks
from ..models.seedvr2.presets import default_dtype
from ..models.seedvr2.weights import WeightsSpec

MAX_UPLOAD_MB = float(1 << 20)  # the largest --max-upload-mb (1 TiB)
ANY_HOST = "*"  # --allow-host value that turns the Host check off


@dataclass
class Settings:
    """The server's settings; ``ValueError`` with one line naming the flag when one makes no sense."""

    data_dir: str
    sp: int = 1
    model: str = "tiny"
    random_weights: bool = False  # seeded random weights where no checkpoint is named (smoke tests, benchmarks)
    dit: str | None = None
    vae: str | None = None
    text_embedding: str | None = None
    dtype: str | None = None
    token: str | None = None
    host: str = "127.0.0.1"  # the address listened on: the Host names a request may carry follow from it
    allow_hosts: list[str] = field(default_factory=list)  # more names for the Host check (ANY_HOST: any)
    allow_origins: list[str] = field(default_factory=list)  # web pages ("scheme://host[:port]") that may call the API
    allow_input: list[str] = field(default_factory=list)
    max_upload_mb: float = 512.0
    threads: int = 1
    timeout_s: float = 60.0
    job_timeout_s: float = 3600.0
    respawn: bool = True
    deterministic: bool = SERVE_DETERMINISTIC  # fixed-shape kernel calls: a re-run job (any SP degree) writes the same frames
    compile: bool = False  # torch.compile'd models, kept compiled in each worker's model cache across jobs
    weights_read: str | None = None  # how the ranks read the checkpoints (ditsp/weights/shared.py; None: its default)
    retention_hours: float | None = None  # results of finished jobs deleted after this long (None: kept)

    def __post_init__(self):
        if self.sp < 1:
            raise ValueError(f"--sp must be >= 1, got {self.sp}")
        check_local_ranks(self.sp)  # every rank is a local worker process: bounded before any is spawned
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        for flag, value in (("--timeout", self.timeout_s), ("--job-timeout", self.job_timeout_s)):
            _seconds(flag, value)
        if not 0 < self.max_upload_mb <= MAX_UPLOAD_MB:
            raise ValueError(f"--max-upload-mb must be in (0, {MAX_UPLOAD_MB:g}], got {self.max_upload_mb}")
        if self.retention_hours is not None:
            _seconds("--retention-hours", self.retention_hours)
        self.allow_hosts = [h if h == ANY_HOST else _host_name(h) for h in self.allow_hosts]
        self.allow_origins = [_origin(o) for o in self.allow_origins]

    @property
    def weights(self):
        return WeightsSpec(self.model, self.dit, self.vae, self.text_embedding,
                           self.dtype or default_dtype(self.model), read=self.weights_read,
                           random_weights=self.random_weights)

    def host_names(self) -> frozenset[str] | None:
        """The names a request's ``Host`` may carry (lower case, no port), or None for any.

        The address listened on; with a loopback one, ``localhost`` and the
        loopback addresses too; a wildcard address (``0.0.0.0``, ``::``) takes
        any name (it needs a token: a page that rebinds a name cannot send it);
        ``--allow-host`` adds names.
        """
        if ANY_HOST in self.allow_hosts:
            return None
        bound = _host_name(self.host, "--host")
        try:
            addr = ipaddress.ip_address(bound)
        except ValueError:
            addr = None
        if addr is not None and addr.is_unspecified:
            return None
        names = {bound, *self.allow_hosts}
        if bound == "localhost" or (addr is not None and addr.is_loopback):
            names |= {"localhost", "127.0.0.1", "::1"}
        return frozenset(names)


def _seconds(flag: str, value) -> None:
    """A duration must be a finite number of seconds above 0 (0, negatives, nan and inf make no sense)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{flag} must be a finite number > 0, got {value}")


def _host_name(text: str, flag: str = "--allow-host") -> str:
    """A host name or address as the Host check compares it: lower case, no brackets, no trailing dot."""
    name = str(text).strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    if not name or any(c in name for c in "/@ ") or (":" in name and not _is_ip(name)):
        raise ValueError(f"{flag} {text!r}: give a host name or address, without a port (or '*' for any)")
    return name


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _origin(text: str) -> str:
    """A web origin as browsers send it: ``scheme://host[:port]``, lower case."""
    o = str(text).strip().lower().rstrip("/")
    parts = urlsplit(o)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment \
            or parts.username or parts.password:
        raise ValueError(f"--allow-origin {text!r}: give an origin as a browser sends it, "
                         f"e.g. https://app.example:8443")
    return o

