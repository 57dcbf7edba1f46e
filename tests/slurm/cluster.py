"""A private single-node Slurm cluster on this machine, everything under one directory.

munged, slurmctld and slurmd run in the foreground as children of this process, each
with its pid recorded, on free ports, with a munge key and socket of their own, so
clusters of several test modules (or a benchmark) never meet. Fake GPUs are device nodes
(clones of /dev/null) named in gres.conf; memory limits use Slurm's cgroup mode (cgroup
v1 here), so a job over its --mem ends OUT_OF_MEMORY. /work/shared/LIBRARIES.md has
what was checked. Clients reach it with the environment of `env()` (SLURM_CONF).

Used by tests/slurm/conftest.py and bench/slurm.py.
"""
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import uuid

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = "apt-get install -y slurm-wlm munge"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name):
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def _die_with_parent():
    """In the daemon, before exec: SIGTERM when the process that started it dies (a test
    run killed before its teardown must not leave a cluster behind)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def missing():
    """Why no cluster can start here (a sentence), or None."""
    need = [n for n in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue",
                        "scancel", "sinfo", "scontrol") if _which(n) is None]
    if need:
        return f"Slurm is not installed ({', '.join(need)} missing; {PACKAGES})"
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root here (slurmd runs jobs as their user)"
    if not os.path.isdir("/sys/fs/cgroup/memory") and not os.path.exists(
            "/sys/fs/cgroup/cgroup.controllers"):
        return "no cgroup memory controller mounted (Slurm's memory limits need one)"
    return None


class SlurmCluster:
    def __init__(self, root, gpus=4, cpus=16, memory_mb=8000, scheduler=None):
        self.root = pathlib.Path(root)
        self.gpus = gpus
        self.cpus = cpus
        self.memory_mb = memory_mb
        tag = uuid.uuid4().hex[:8]
        self.cluster = f"gp{tag}"
        self.node = f"gpn{tag}"       # also the cgroup dir's name: unique per cluster
        self.partition = "gpu"
        # a job asking for more stays PENDING (PartitionTimeLimit): the tests' pending job
        self.max_time_min = 60
        # Slurm starts a job only from its scheduler's pass; these make that pass as
        # prompt as the built-in scheduler allows (LIBRARIES.md: defaults wait ~3 s)
        self.scheduler = scheduler if scheduler is not None else (
            "batch_sched_delay=0,sched_min_interval=0,bf_interval=1")
        self.procs = {}
        self.conf = self.root / "etc" / "slurm.conf"

    # -- files ------------------------------------------------------------------------

    def _write_config(self):
        r = self.root
        for d in ("etc", "state", "spool", "log", "run", "munge", "dev"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o711)   # clients need to reach the socket
        for i in range(self.gpus):
            dev = r / "dev" / f"fakegpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        scheduler_line = f"SchedulerParameters={self.scheduler}\n" if self.scheduler else ""
        self.conf.write_text(f"""\
ClusterName={self.cluster}
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
MailProg=/bin/true
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
{scheduler_line}SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU={self.memory_mb // self.cpus}
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
MpiDefault=none
KillWait=5
ReturnToService=2
MinJobAge=3600
InactiveLimit=0
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb}{gres} State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime={self.max_time_min} State=UP
""")
        (r / "etc" / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainRAMSpace=yes\n"
            "ConstrainSwapSpace=yes\nAllowedSwapSpace=0\nConstrainCores=no\n"
            "ConstrainDevices=no\n")
        gres_lines = ["AutoDetect=off"]
        if self.gpus:
            gres_lines.append(f"NodeName={self.node} Name=gpu "
                              f"File={r}/dev/fakegpu[0-{self.gpus - 1}]")
        (r / "etc" / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        key = r / "munge" / "munge.key"
        if not key.exists():
            subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True,
                           capture_output=True)
            os.chmod(key, 0o600)

    def env(self, base=None):
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # -- daemons ----------------------------------------------------------------------

    def _spawn(self, name, argv):
        out = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env(),
                                            start_new_session=True,
                                            preexec_fn=_die_with_parent)
        out.close()

    def start(self, timeout=60):
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout):
        self._write_config()
        r = self.root
        self._spawn("munged", [_which("munged"), "-F", "--force",
                               f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/munge/munge.socket.2",
                               f"--pid-file={r}/munge/munged.pid",
                               f"--seed-file={r}/munge/munge.seed",
                               f"--log-file={r}/log/munged.log"])
        self._wait(lambda: (r / "munge" / "munge.socket.2").exists(), timeout, "munged")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping").returncode == 0, timeout, "slurmctld")
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, "slurmd (an idle node)")
        return self

    def _node_idle(self):
        r = self.run("sinfo", "-h", "-n", self.node, "-o", "%t")
        return r.returncode == 0 and r.stdout.split()[:1] in (["idle"], ["mix"], ["alloc"])

    def _wait(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see "
                                       f"{self.root}/log/\n" + self.logs())
            try:
                if cond():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}; see {self.root}/log/\n" + self.logs())

    def logs(self, tail=3000):
        out = []
        for f in sorted((self.root / "log").glob("*")):
            try:
                out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
            except OSError:
                pass
        return "\n".join(out)

    def run(self, *argv, timeout=30, **kw):
        return subprocess.run([_which(argv[0]) or argv[0], *argv[1:]], capture_output=True,
                              text=True, timeout=timeout, env=self.env(), **kw)

    def jobs(self):
        """Slurm job ids this cluster still holds that are not finished."""
        r = self.run("squeue", "-h", "-o", "%i")
        return r.stdout.split() if r.returncode == 0 else []

    def stop(self):
        """Cancel every job, then TERM slurmd, slurmctld, munged; anything left of a job
        (slurmstepd renames itself, so found by an open file or cwd under the root) is
        killed, and the job cgroups Slurm made are removed."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                self.run("scancel", "--full", "--user", "root", timeout=10)
                deadline = time.monotonic() + 8
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._kill_leftovers()
        self._remove_cgroups()

    def _kill_leftovers(self):
        root = str(self.root)
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                paths = [os.readlink(f"/proc/{pid}/cwd")]
                fds = f"/proc/{pid}/fd"
                paths += [os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)]
            except OSError:
                continue
            if any(p.startswith(root + "/") or p == root for p in paths):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass

    def _remove_cgroups(self):
        # a killed job's cgroup empties a moment after its processes are gone
        deadline = time.monotonic() + 3
        while True:
            self._rmdir_cgroups()
            if not list(pathlib.Path("/sys/fs/cgroup").glob(f"*/slurm_{self.node}")) \
                    or time.monotonic() > deadline:
                return
            time.sleep(0.2)

    def _rmdir_cgroups(self):
        for top in pathlib.Path("/sys/fs/cgroup").glob(f"*/slurm_{self.node}"):
            # deepest first: a cgroup dir is removed with rmdir once it is empty
            for d in sorted(top.rglob("*"), key=lambda p: -len(p.parts)):
                if d.is_dir():
                    try:
                        d.rmdir()
                    except OSError:
                        pass
            try:
                top.rmdir()
            except OSError:
                pass
