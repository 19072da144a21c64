"""Seccomp-BPF policies for sandboxed children.

The policy is Docker-shaped but default-ALLOW: a declarative deny table (``_DEFAULT_RULES``) is compiled with
libseccomp (pyseccomp) into a raw BPF program, behind a prologue of our own (the review's newest
syscall, and the argument checks libseccomp writes long: ``_IN_PROLOGUE``), cached on disk, and
installed with a bare ``seccomp(2)`` call. pyseccomp, ctypes and hashlib are imported lazily so that importing this module
stays well under 2 ms and a CLI run with a warm cache never pays pyseccomp's ~55 ms import.
"""

import errno
import os
import stat
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

POLICIES = ("default", "off")

# Bump whenever the rule table *or its compilation* changes: it is part of the disk-cache key.
POLICY_VERSION = 8

# The newest syscall the table was reviewed against: file_setattr (469, Linux 6.17; x86_64 and
# aarch64 share every number from 424 on). A syscall added after it gets ENOSYS, as from an older
# kernel (libc falls back, as for clone3), instead of slipping past a deny list written before it
# existed. On a new kernel: review its new syscalls, deny what must be, then raise this.
NEWEST_REVIEWED_NR = 469
# Numbers below 424 that no syscall has on x86_64 yet (its own table ends at 336, uprobe): one
# added there later is new too. (aarch64's table ends at 294; its numbers up to 423 belong to
# 32-bit time64 calls, so nothing new is expected there.)
_UNASSIGNED_BELOW_424: dict[str, tuple[int, int]] = {"x86_64": (337, 423)}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_EPERM = errno.EPERM
_ENOSYS = errno.ENOSYS
_EOPNOTSUPP = errno.EOPNOTSUPP
_MAP_HUGETLB, _MFD_HUGETLB, _SHM_HUGETLB = 0x40000, 0x4, 0o4000

# Condition on one syscall argument: (arg index, op, a, b).
#   "EQ"/"GE"/"GT": arg <op> a (full 64-bit compare, b unused)
#   "MASKED_EQ":    (arg & a) == b
#   "NOT_IN":       arg not in a (a tuple of allowed values) -- lowered at compile time, see _expand()
#   "MASKED_NOT_IN": (arg & b) not in a (a tuple of allowed values, each within the mask b)
#   "ALL":          every condition of a holds: (an "EQ" guard on one argument, then a condition on
#                   another); the index is unused
Cond = tuple[int, str, "int | tuple[int, ...] | tuple[Cond, ...]", int]
# One row: (syscall, errno returned, conditions OR-ed together -- () means always, reason for docs).
Rule = tuple[str, int, tuple[Cond, ...], str]

_CLONE_NS_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    # In clone(2) 0x80 lies inside CSIGNAL (exit signal), so this only refuses exit signals >= 128,
    # which are invalid anyway; CLONE_NEWTIME itself is reachable only via clone3/unshare (both denied).
    "CLONE_NEWTIME": 0x00000080,
}
_LOW32 = 0xFFFFFFFF
_TIOCSTI, _TIOCLINUX, _TIOCSETD = 0x5412, 0x541C, 0x5423
_S_IFMT, _S_IFCHR, _S_IFBLK = 0o170000, 0o020000, 0o060000
_S_ISUID, _S_ISGID, _S_IXGRP = 0o4000, 0o2000, 0o0010
# PER_LINUX (0), PER_LINUX32 (0x8), UNAME26 (0x20000), PER_LINUX32|UNAME26 (as Docker), and 0xffffffff = query.
_PERSONALITY_ALLOWED = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)

_CLONE_NS: tuple[Cond, ...] = tuple((0, "MASKED_EQ", f, f) for f in _CLONE_NS_FLAGS.values())
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK, _NETLINK_ROUTE = 1, 2, 10, 16, 0
# Protocols: the default (0), ICMP (1, also PF_UNIX's own number), TCP (6), UDP (17), ICMPv6 (58).
# Any other (SCTP, DCCP, L2TP, ...) makes the kernel load that protocol's module on demand, and
# those rarely used modules are where socket exploits have come from.
_PROTO_ALLOWED = (0, 1, 6, 17, 58)
# socket()'s type, less its SOCK_NONBLOCK/SOCK_CLOEXEC flags (the kernel's SOCK_TYPE_MASK):
# STREAM, DGRAM, RAW and, but for inet, SEQPACKET. Not SOCK_PACKET (an inet socket the kernel
# makes a packet one), DCCP or RDM; not SEQPACKET for inet, which with protocol 0 is SCTP's.
_SOCK_TYPE_MASK, _SOCK_STREAM, _SOCK_DGRAM, _SOCK_RAW, _SOCK_SEQPACKET = 0xF, 1, 2, 3, 5
_INET_TYPES = (_SOCK_STREAM, _SOCK_DGRAM, _SOCK_RAW)
# Everything but AF_UNIX, also with upper bits set, which the kernel would truncate to an
# allowed int. (Only AF_UNIX makes pairs; for another family the kernel creates both sockets
# before it says EOPNOTSUPP, loading their modules and rewriting SOCK_PACKET as socket() does.)
_SOCKETPAIR_DENIED: tuple[Cond, ...] = ((0, "NOT_IN", (_AF_UNIX,), 0), (2, "NOT_IN", _PROTO_ALLOWED, 0))
# socket() also takes AF_NETLINK with NETLINK_ROUTE alone, as Docker's policy does: what lists
# interfaces and addresses (getifaddrs, `ip addr`, if_nameindex, Go's net.Interfaces). Changing
# links, addresses or routes takes CAP_NET_ADMIN, which no command has; every other netlink
# family (audit, xfrm, netfilter, generic, ...) stays refused.
_SOCKET_DENIED: tuple[Cond, ...] = (
    (0, "NOT_IN", (_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK), 0),
    (2, "NOT_IN", _PROTO_ALLOWED, 0),
    (0, "ALL", ((0, "EQ", _AF_NETLINK, 0), (2, "NOT_IN", (_NETLINK_ROUTE,), 0)), 0),
    (1, "MASKED_NOT_IN", (*_INET_TYPES, _SOCK_SEQPACKET), _SOCK_TYPE_MASK),
    *((0, "ALL", ((0, "EQ", family, 0), (1, "MASKED_NOT_IN", _INET_TYPES, _SOCK_TYPE_MASK)), 0)
      for family in (_AF_INET, _AF_INET6)),
)
# cmd is an unsigned int in the kernel: compare the low 32 bits only (CVE-2019-10063). TIOCSETD
# sets a line discipline, loading its module on demand (n_hdlc: CVE-2017-2636).
_TTY_DENIED: tuple[Cond, ...] = tuple((1, "MASKED_EQ", _LOW32, cmd) for cmd in (_TIOCSTI, _TIOCLINUX, _TIOCSETD))


def _devnode_or_setid(i: int) -> tuple[Cond, ...]:
    return (
        (i, "MASKED_EQ", _S_IFMT, _S_IFCHR),
        (i, "MASKED_EQ", _S_IFMT, _S_IFBLK),
        (i, "MASKED_EQ", _S_ISUID, _S_ISUID),
        (i, "MASKED_EQ", _S_ISGID, _S_ISGID),
    )


def _setid_exec(i: int) -> tuple[Cond, ...]:
    # execve honours S_ISGID only together with S_IXGRP, so plain S_ISGID (e.g. 0o2644) stays allowed;
    # setgid directories with g+x can still be had by inheritance from a setgid parent (mkdir).
    sgid_x = _S_ISGID | _S_IXGRP
    return ((i, "MASKED_EQ", _S_ISUID, _S_ISUID), (i, "MASKED_EQ", sgid_x, sgid_x))


_DENY_ALWAYS = "kernel attack surface, escape or host-global state"

_DEFAULT_RULES: tuple[Rule, ...] = (
    # process introspection / other processes' memory
    ("ptrace", _EPERM, (), _DENY_ALWAYS),
    ("process_vm_readv", _EPERM, (), _DENY_ALWAYS),
    ("process_vm_writev", _EPERM, (), _DENY_ALWAYS),
    ("kcmp", _EPERM, (), _DENY_ALWAYS),
    ("pidfd_getfd", _EPERM, (), _DENY_ALWAYS),
    # mounts and namespaces (new mount API included)
    ("mount", _EPERM, (), _DENY_ALWAYS),
    ("umount", _EPERM, (), _DENY_ALWAYS),
    ("umount2", _EPERM, (), _DENY_ALWAYS),
    ("pivot_root", _EPERM, (), _DENY_ALWAYS),
    ("chroot", _EPERM, (), _DENY_ALWAYS),
    ("fsopen", _EPERM, (), _DENY_ALWAYS),
    ("fsconfig", _EPERM, (), _DENY_ALWAYS),
    ("fsmount", _EPERM, (), _DENY_ALWAYS),
    ("fspick", _EPERM, (), _DENY_ALWAYS),
    ("move_mount", _EPERM, (), _DENY_ALWAYS),
    ("open_tree", _EPERM, (), _DENY_ALWAYS),
    ("open_tree_attr", _EPERM, (), _DENY_ALWAYS),
    ("mount_setattr", _EPERM, (), _DENY_ALWAYS),
    ("unshare", _EPERM, (), _DENY_ALWAYS),
    ("setns", _EPERM, (), _DENY_ALWAYS),
    ("clone", _EPERM, _CLONE_NS, "any CLONE_NEW* namespace flag"),
    # clone3's flags live in a struct seccomp cannot read; glibc falls back to clone() on ENOSYS.
    ("clone3", _ENOSYS, (), "flags not inspectable; forces the clone() fallback"),
    # kernel keyring
    ("keyctl", _EPERM, (), _DENY_ALWAYS),
    ("add_key", _EPERM, (), _DENY_ALWAYS),
    ("request_key", _EPERM, (), _DENY_ALWAYS),
    # large kernel attack surface
    ("bpf", _EPERM, (), _DENY_ALWAYS),
    ("perf_event_open", _EPERM, (), _DENY_ALWAYS),
    ("userfaultfd", _EPERM, (), _DENY_ALWAYS),
    ("io_uring_setup", _EPERM, (), _DENY_ALWAYS),
    ("io_uring_enter", _EPERM, (), _DENY_ALWAYS),
    ("io_uring_register", _EPERM, (), _DENY_ALWAYS),
    ("modify_ldt", _EPERM, (), _DENY_ALWAYS),  # x86 segment descriptors: old, bug-prone (Docker allows it; not needed here)
    ("open_by_handle_at", _EPERM, (), _DENY_ALWAYS),
    ("name_to_handle_at", _EPERM, (), _DENY_ALWAYS),
    ("fanotify_init", _EPERM, (), _DENY_ALWAYS),
    ("lookup_dcookie", _EPERM, (), _DENY_ALWAYS),
    # modules, kexec, power
    ("init_module", _EPERM, (), _DENY_ALWAYS),
    ("finit_module", _EPERM, (), _DENY_ALWAYS),
    ("delete_module", _EPERM, (), _DENY_ALWAYS),
    ("create_module", _EPERM, (), _DENY_ALWAYS),
    ("get_kernel_syms", _EPERM, (), _DENY_ALWAYS),
    ("query_module", _EPERM, (), _DENY_ALWAYS),
    ("kexec_load", _EPERM, (), _DENY_ALWAYS),
    ("kexec_file_load", _EPERM, (), _DENY_ALWAYS),
    ("reboot", _EPERM, (), _DENY_ALWAYS),
    # host-global state: swap, clocks, accounting, quotas, names, kernel log, LSM attributes
    ("swapon", _EPERM, (), _DENY_ALWAYS),
    ("swapoff", _EPERM, (), _DENY_ALWAYS),
    ("settimeofday", _EPERM, (), _DENY_ALWAYS),
    ("stime", _EPERM, (), _DENY_ALWAYS),
    ("clock_settime", _EPERM, (), _DENY_ALWAYS),
    ("clock_adjtime", _EPERM, (), _DENY_ALWAYS),
    ("adjtimex", _EPERM, (), _DENY_ALWAYS),
    ("acct", _EPERM, (), _DENY_ALWAYS),
    ("quotactl", _EPERM, (), _DENY_ALWAYS),
    ("quotactl_fd", _EPERM, (), _DENY_ALWAYS),
    ("sethostname", _EPERM, (), _DENY_ALWAYS),
    ("setdomainname", _EPERM, (), _DENY_ALWAYS),
    ("syslog", _EPERM, (), _DENY_ALWAYS),
    ("lsm_set_self_attr", _EPERM, (), _DENY_ALWAYS),
    ("nfsservctl", _EPERM, (), _DENY_ALWAYS),
    ("vhangup", _EPERM, (), _DENY_ALWAYS),
    # raw I/O ports, vm86 mode, obsolete interfaces
    ("iopl", _EPERM, (), _DENY_ALWAYS),
    ("ioperm", _EPERM, (), _DENY_ALWAYS),
    ("vm86", _EPERM, (), _DENY_ALWAYS),
    ("vm86old", _EPERM, (), _DENY_ALWAYS),
    ("uselib", _EPERM, (), _DENY_ALWAYS),
    ("ustat", _EPERM, (), _DENY_ALWAYS),
    ("sysfs", _EPERM, (), _DENY_ALWAYS),
    ("_sysctl", _EPERM, (), _DENY_ALWAYS),
    # Pools the whole host shares and no cgroup limit covers: one run could take them all.
    # Native AIO contexts (fs.aio-max-nr): ENOSYS, as from a kernel without them, so libaio
    # users fall back to threads. Huge pages (vm.nr_hugepages) are charged to no memory limit.
    ("io_setup", _ENOSYS, (), "fs.aio-max-nr is host-wide; ENOSYS makes libaio users fall back"),
    ("mmap", _EPERM, ((3, "MASKED_EQ", _MAP_HUGETLB, _MAP_HUGETLB),), "MAP_HUGETLB (host-wide huge page pool)"),
    ("memfd_create", _EPERM, ((1, "MASKED_EQ", _MFD_HUGETLB, _MFD_HUGETLB),), "MFD_HUGETLB (host-wide huge pages)"),
    ("shmget", _EPERM, ((2, "MASKED_EQ", _SHM_HUGETLB, _SHM_HUGETLB),), "SHM_HUGETLB (host-wide huge pages)"),
    # Extended attributes: a default ACL set on a directory of a host workdir (--cwd) would
    # open up the files its owner creates there after the run, whatever their umask.
    # EOPNOTSUPP, as from a filesystem without them (shutil.copystat and cp -a carry on).
    *((name, _EOPNOTSUPP, (), "setting xattrs (POSIX ACLs): a default ACL outlives the run")
      for name in ("setxattr", "lsetxattr", "fsetxattr", "setxattrat")),
    # NUMA placement of (other processes') memory; reading the policy too, as Docker does: libnuma's
    # numa_available() asks get_mempolicy, and allowed alone it said NUMA works where binding fails
    ("get_mempolicy", _EPERM, (), _DENY_ALWAYS),
    ("move_pages", _EPERM, (), _DENY_ALWAYS),
    ("mbind", _EPERM, (), _DENY_ALWAYS),
    ("set_mempolicy", _EPERM, (), _DENY_ALWAYS),
    ("set_mempolicy_home_node", _EPERM, (), _DENY_ALWAYS),
    ("migrate_pages", _EPERM, (), _DENY_ALWAYS),
    # sockets: AF_UNIX, AF_INET, AF_INET6, with their built-in protocols only; AF_NETLINK for routing
    # information only (NETLINK_ROUTE)
    ("socket", _EPERM, _SOCKET_DENIED, "family not in {AF_UNIX, AF_INET, AF_INET6, AF_NETLINK}, or "
     "protocol not in {0, ICMP, TCP, UDP, ICMPv6}, or AF_NETLINK with another protocol than NETLINK_ROUTE, "
     "or type not STREAM, DGRAM, RAW (or SEQPACKET, but for inet): not SOCK_PACKET, DCCP, RDM"),
    ("socketpair", _EPERM, _SOCKETPAIR_DENIED, "family not AF_UNIX, or protocol not in "
     "{0, ICMP, TCP, UDP, ICMPv6}"),
    # terminal input injection, line disciplines
    ("ioctl", _EPERM, _TTY_DENIED, "TIOCSTI / TIOCLINUX / TIOCSETD"),
    ("personality", _EPERM, ((0, "NOT_IN", _PERSONALITY_ALLOWED, 0),), "e.g. READ_IMPLIES_EXEC"),
    # device nodes and setuid/setgid files
    ("mknod", _EPERM, _devnode_or_setid(1), "char/block device or S_ISUID/S_ISGID"),
    ("mknodat", _EPERM, _devnode_or_setid(2), "char/block device or S_ISUID/S_ISGID"),
    ("chmod", _EPERM, _setid_exec(1), "S_ISUID, or S_ISGID with S_IXGRP"),
    ("fchmod", _EPERM, _setid_exec(1), "S_ISUID, or S_ISGID with S_IXGRP"),
    ("fchmodat", _EPERM, _setid_exec(2), "S_ISUID, or S_ISGID with S_IXGRP"),
    ("fchmodat2", _EPERM, _setid_exec(2), "S_ISUID, or S_ISGID with S_IXGRP"),
    # The mode is ignored without O_CREAT/O_TMPFILE (glibc then passes 0), so no flags check is needed.
    ("open", _EPERM, _setid_exec(2), "S_ISUID, or S_ISGID with S_IXGRP"),
    ("openat", _EPERM, _setid_exec(3), "S_ISUID, or S_ISGID with S_IXGRP"),
    ("creat", _EPERM, _setid_exec(1), "S_ISUID, or S_ISGID with S_IXGRP"),
    # openat2's mode sits inside struct open_how; glibc does not use it, others fall back to openat.
    ("openat2", _ENOSYS, (), "mode not inspectable; forces the openat() fallback"),
)
# Arguments shown in octal by describe_policy().
_OCTAL_SYSCALLS = frozenset(["mknod", "mknodat", "chmod", "fchmod", "fchmodat", "fchmodat2", "open",
                             "openat", "creat"])

_POLICY_RULES: dict[str, tuple[Rule, ...]] = {"default": _DEFAULT_RULES, "off": ()}

# Generic (asm-generic, >= 424) syscall numbers shared by x86_64 and aarch64, used when the installed
# libseccomp is older than the syscall. Only consulted for those two architectures.
_UNIFIED_NR: dict[str, int] = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
    "openat2": 437, "pidfd_getfd": 438, "mount_setattr": 442, "quotactl_fd": 443,
    "set_mempolicy_home_node": 450, "fchmodat2": 452, "lsm_set_self_attr": 460, "setxattrat": 463,
    "open_tree_attr": 467,
}
_UNIFIED_ARCHES = ("x86_64", "aarch64")

_SECCOMP_NR = {"x86_64": 317, "aarch64": 277}
_SECCOMP_SET_MODE_FILTER = 1
_BPF_MAXINSNS = 4096

_SKIPPED: dict[str, list[str]] = {}
_memo: dict[str, bytes] = {}


def _check_name(name: str) -> None:
    if name not in _POLICY_RULES:
        raise ValueError(f"unknown seccomp policy {name!r}; choose one of {POLICIES}")


def _fmt_cond(cond: Cond, octal: bool) -> str:
    idx, op, a, b = cond
    if op == "MASKED_EQ":
        return f"(arg{idx} & {a:#o}) == {b:#o}" if octal else f"(arg{idx} & {a:#x}) == {b:#x}"
    if op == "NOT_IN":
        assert isinstance(a, tuple)
        return f"arg{idx} not in {{{', '.join(f'{v:#x}' for v in a)}}}"
    if op == "MASKED_NOT_IN":
        assert isinstance(a, tuple)
        return f"(arg{idx} & {b:#x}) not in {{{', '.join(f'{v:#x}' for v in a)}}}"
    if op == "ALL":
        assert isinstance(a, tuple)
        return "(" + " and ".join(_fmt_cond(c, octal) for c in a) + ")"
    sym = {"EQ": "==", "GE": ">=", "GT": ">"}[op]
    return f"arg{idx} {sym} {a}"


def describe_policy(name: str = "default") -> list[str]:
    """Human-readable rule list (README/tests); also part of the disk-cache key."""
    _check_name(name)
    rules = _POLICY_RULES[name]
    if not rules:
        return ["no seccomp filter"]
    gap = _UNASSIGNED_BELOW_424.get(os.uname().machine)
    lines = [
        "default action: ALLOW",
        "non-native ABI (i386 int 0x80, x32 nr >= 0x40000000): KILL_PROCESS",
        f"syscalls newer than the review (nr > {NEWEST_REVIEWED_NR}"
        + (f"; {gap[0]}..{gap[1]}, unassigned on this arch" if gap else "") + "): ERRNO(ENOSYS)",
    ]
    for sc, err, conds, why in rules:
        action = f"ERRNO({errno.errorcode.get(err, err)})"
        octal = sc in _OCTAL_SYSCALLS
        when = " or ".join(_fmt_cond(c, octal) for c in conds)
        lines.append(f"{sc}: {action}" + (f" if {when}" if when else "") + f"  # {why}")
    return lines


def _aligned_blocks(lo: int, hi: int) -> list[tuple[int, int]]:
    """Split [lo, hi] into power-of-two aligned blocks (start, size): each is one MASKED_EQ."""
    out: list[tuple[int, int]] = []
    while lo <= hi:
        size = lo & -lo if lo else 1 << 64
        while size > hi - lo + 1:
            size >>= 1
        out.append((lo, size))
        lo += size
    return out


def _expand(cond: Cond) -> list[tuple[int, str, int, int]]:
    """Lower a table condition to single-comparison conditions that are OR-ed together.

    libseccomp 2.5 refuses two comparisons of the same argument in one rule, so "arg not in S" is
    written as "arg > max(S)" plus aligned MASKED_EQ blocks covering every gap below max(S).
    """
    idx, op, a, b = cond
    if op == "MASKED_NOT_IN":  # one MASKED_EQ per value the mask leaves that is not allowed
        assert isinstance(a, tuple) and 0 < b < 256, cond
        return [(idx, "MASKED_EQ", b, v) for v in range(b + 1) if v & b == v and v not in a]
    if op not in ("NOT_IN", "ALL"):
        assert isinstance(a, int)
        return [(idx, op, a, b)]
    assert op == "NOT_IN", "an ALL condition is lowered by _conjunctions()"
    assert isinstance(a, tuple)
    allowed = sorted(a)
    out = [(idx, "GT", allowed[-1], 0)]
    prev = -1
    for v in allowed:
        for start, size in _aligned_blocks(prev + 1, v - 1):
            out.append((idx, "MASKED_EQ", ((1 << 64) - 1) ^ (size - 1), start))
        prev = v
    return out


def _conjunctions(cond: Cond) -> list[tuple[tuple[int, str, int, int], ...]]:
    """Lower a table condition to rules OR-ed together, each single comparisons that must all
    hold (libseccomp ANDs the comparisons of one rule): one per comparison, or for "ALL" one per
    combination of its conditions' comparisons (on distinct arguments, as libseccomp wants)."""
    if cond[1] != "ALL":
        return [(low,) for low in _expand(cond)]
    parts = cond[2]
    assert isinstance(parts, tuple) and len({c[0] for c in parts}) == len(parts), cond
    out: list[tuple[tuple[int, str, int, int], ...]] = [()]
    for part in parts:
        out = [(*done, low) for done in out for low in _expand(part)]  # type: ignore[arg-type]
    return out


# Rules checked by the prologue's own BPF rather than by libseccomp's program: their arguments
# are sets of small values or single flag bits, which libseccomp can only write as 64-bit
# compares of aligned blocks (personality's 5 allowed values took 83 of them, some 330 of the
# program's 500 instructions). The kernel JIT-compiles the program at every run's load, so its
# length is paid once a run (~180 µs for 500 instructions here).
_IN_PROLOGUE = ("personality", "socket", "socketpair", "clone")
_LD_W_ABS, _AND, _JEQ, _JGT, _JGE, _JSET, _JA, _RET = 0x20, 0x54, 0x15, 0x25, 0x35, 0x45, 0x05, 0x06
_RET_ERRNO = 0x00050000  # SECCOMP_RET_ERRNO | errno
_ARGS_AT = 16  # offsetof(struct seccomp_data, args); little-endian: the low word first

Target = int | str  # a fixed value, or a label resolved by _assemble
Insn = tuple[int, Target, Target, Target]


def _arg_checks(nr: int, err: int, conds: tuple[Cond, ...], n: int) -> list[Insn | str]:
    """BPF for one prologue rule (`n` makes its labels unique): with A = the syscall number,
    ERRNO(err) if any condition holds, else on to the program; another syscall skips it all.
    Only what the kernel reads as a 32-bit int: "NOT_IN" (allowed: the upper word 0 and the
    lower one of the values), "MASKED_NOT_IN" (of the lower word alone, as the kernel reads an
    int), "MASKED_EQ" of one bit of the lower word (the bits OR-ed into one test), and "ALL"
    of an "EQ" guard and a "NOT_IN" or "MASKED_NOT_IN"."""
    deny, skip = f"errno{err}", f"skip{n}"
    out: list[Insn | str] = [(_JEQ, 0, skip, nr)]
    bits: dict[int, int] = {}
    for k, (idx, op, a, b) in enumerate(conds):
        lo = _ARGS_AT + 8 * idx
        if op in ("NOT_IN", "MASKED_NOT_IN"):
            ok = f"ok{n}.{k}"
            out += [*_not_in(nr, (idx, op, a, b), deny, ok), ok]
        elif (op == "ALL" and isinstance(a, tuple) and len(a) == 2 and a[0][1] == "EQ"
              and a[1][1] in ("NOT_IN", "MASKED_NOT_IN")):
            # the guard: the argument is this value (its upper word 0); then the NOT_IN as above
            g_idx, _eq, g_val, _ = a[0]
            assert isinstance(g_val, int) and 0 <= g_val <= _LOW32, (nr, a)
            ok = f"ok{n}.{k}"
            g_lo, g_hi = _ARGS_AT + 8 * g_idx, _ARGS_AT + 8 * g_idx + 4
            out += [(_LD_W_ABS, 0, 0, g_hi), (_JEQ, 0, ok, 0), (_LD_W_ABS, 0, 0, g_lo), (_JEQ, 0, ok, g_val)]
            out += [*_not_in(nr, a[1], deny, ok), ok]
        elif op == "MASKED_EQ" and isinstance(a, int) and a == b and 0 < a <= _LOW32 and a & (a - 1) == 0:
            bits[lo] = bits.get(lo, 0) | a
        else:
            raise ValueError(f"syscall {nr}: condition {(idx, op, a, b)} is not one the prologue checks")
    for lo, mask in bits.items():
        out += [(_LD_W_ABS, 0, 0, lo), (_JSET, deny, 0, mask)]
    return [*out, (_JA, 0, 0, "prog"), skip]


def _not_in(nr: int, cond: Cond, deny: str, ok: str) -> list[Insn | str]:
    """To `ok` if the argument is one of the allowed values, else to `deny`. NOT_IN compares
    the whole 64 bits (the upper word 0), MASKED_NOT_IN the lower word under its mask."""
    idx, op, allowed, mask = cond
    assert isinstance(allowed, tuple) and all(0 <= v <= _LOW32 for v in allowed), (nr, cond)
    lo, hi = _ARGS_AT + 8 * idx, _ARGS_AT + 8 * idx + 4
    if op == "NOT_IN":
        out: list[Insn | str] = [(_LD_W_ABS, 0, 0, hi), (_JEQ, 0, deny, 0), (_LD_W_ABS, 0, 0, lo)]
    else:
        assert op == "MASKED_NOT_IN" and 0 < mask <= _LOW32, (nr, cond)
        out = [(_LD_W_ABS, 0, 0, lo), (_AND, 0, 0, mask)]
    return out + [(_JEQ, ok, deny if j == len(allowed) - 1 else 0, v) for j, v in enumerate(allowed)]


def _assemble(code: list[Insn | str]) -> bytes:
    """Classic BPF from instructions and labels (str items): jumps are forward only, jt/jf
    within 255 instructions."""
    where: dict[str, int] = {}
    insns: list[Insn] = []
    for item in code:
        if isinstance(item, str):
            where[item] = len(insns)
        else:
            insns.append(item)
    out = b""
    for i, (op, jt, jf, k) in enumerate(insns):
        jt, jf = (where[t] - i - 1 if isinstance(t, str) else t for t in (jt, jf))
        k = where[k] - i - 1 if isinstance(k, str) else k
        if not (0 <= jt <= 255 and 0 <= jf <= 255 and 0 <= k <= 0xFFFFFFFF):
            raise RuntimeError("seccomp prologue: a jump out of range")
        out += struct.pack("<HBBI", op, jt, jf, k)
    return out


def _prologue(machine: str, newest: int, gap: tuple[int, int] | None,
              checks: list[tuple[int, int, tuple[Cond, ...]]], program_len: int) -> bytes:
    """BPF run before libseccomp's program: ENOSYS for a native syscall number above `newest`
    or inside `gap`; the `_IN_PROLOGUE` rules (`checks`: nr, errno, conditions); everything
    else (a foreign arch, x32 numbers too) goes on to the program, which decides as before.
    Classic BPF jumps are relative and forward only, so prepending leaves the program's own
    jumps intact."""
    code: list[Insn | str] = [
        (_LD_W_ABS, 0, 0, 4),  # A = seccomp_data.arch
        (_JEQ, 0, "prog", _AUDIT_ARCH[machine]),
        (_LD_W_ABS, 0, 0, 0),  # A = seccomp_data.nr
        (_JGE, "prog", 0, 0x40000000),  # x32 (x86_64): the program kills it
        (_JGT, "enosys", 0, newest),
    ]
    if gap:
        code += [(_JGE, 0, "args", gap[0]), (_JGT, "args", "enosys", gap[1])]
    code.append("args")
    for n, (nr, err, conds) in enumerate(checks):
        code += _arg_checks(nr, err, conds, n)
    code += [(_JA, 0, 0, "prog"), "enosys", (_RET, 0, 0, _RET_ERRNO | _ENOSYS)]
    for err in dict.fromkeys(err for _nr, err, _c in checks):
        code += [f"errno{err}", (_RET, 0, 0, _RET_ERRNO | err)]
    code.append("prog")
    out = _assemble(code)
    if len(out) // 8 + program_len > _BPF_MAXINSNS:
        raise RuntimeError("seccomp program too long with its prologue")
    return out


def compile_policy(name: str = "default", *, newest: int = NEWEST_REVIEWED_NR,
                   gap: tuple[int, int] | None | bool = True, prologue_rules: bool = True,
                   rule_errno: int | None = None) -> bytes:
    """Build the raw BPF program (struct sock_filter[]) for the native architecture.
    `newest`, `gap` (True: this arch's unassigned range): the syscalls answered ENOSYS as newer
    than the review; tests lower them to prove the mechanism on syscalls this kernel has.
    `prologue_rules` False leaves every rule to libseccomp (tests compare the two programs).
    `rule_errno` (tests): every rule of the table answers this errno instead of its own, one
    no kernel path gives, so a test can tell the filter's answer from the kernel's."""
    _check_name(name)
    rules = _POLICY_RULES[name]
    if not rules:
        return b""
    try:
        import pyseccomp as sc  # lazy: ~55 ms import, only paid on a cache miss
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: its find_library could not fork ldconfig
        raise PolicyUnavailable(getattr(e, "errno", None) or 0,
                                f"cannot compile the seccomp filter {name!r}: libseccomp unavailable ({e})") from None

    machine = os.uname().machine
    ops = {"EQ": sc.EQ, "GE": sc.GE, "GT": sc.GT, "MASKED_EQ": sc.MASKED_EQ}
    filt = sc.SyscallFilter(defaction=sc.ALLOW)
    # i386 (int 0x80) fails the arch check; libseccomp's x86_64 filter also sends x32 numbers
    # (nr >= 0x40000000) to this action (verified by the tests).
    filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    try:
        filt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)  # binary tree: fewer jumps for hot arg-checked syscalls
    except OSError:
        pass
    skipped: list[str] = []
    in_prologue: list[tuple[int, int, tuple[Cond, ...]]] = []
    for sysname, err, conds, _why in rules:
        err = err if rule_errno is None else rule_errno
        nr = sc.resolve_syscall(sc.Arch.NATIVE, sysname)
        if nr == -1 and machine in _UNIFIED_ARCHES:
            nr = _UNIFIED_NR.get(sysname, -1)
        if nr < 0:  # unknown (-1) or a pseudo-syscall absent on this arch (<= -10000)
            if sysname not in skipped:
                skipped.append(sysname)
            continue
        if prologue_rules and machine in _AUDIT_ARCH and sysname in _IN_PROLOGUE and conds:
            in_prologue.append((nr, err, conds))
            continue
        if not conds:
            filt.add_rule(sc.ERRNO(err), nr)
        # One libseccomp rule per conjunction of comparisons: rules with the same action are OR-ed.
        for rule in (conj for c in conds for conj in _conjunctions(c)):
            filt.add_rule(sc.ERRNO(err), nr, *(sc.Arg(idx, ops[op], a, b) for idx, op, a, b in rule))
    _SKIPPED[name] = skipped
    fd = os.memfd_create(f"seccomp-{name}", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as f:
        filt.export_bpf(f)
        f.seek(0)
        prog = f.read()
    if not _valid_prog(prog):
        raise RuntimeError(f"libseccomp produced an invalid BPF program ({len(prog)} bytes)")
    if machine in _AUDIT_ARCH:
        span = _UNASSIGNED_BELOW_424.get(machine) if gap is True else gap or None
        prog = _prologue(machine, newest, span, in_prologue, len(prog) // 8) + prog
    return prog


def skipped_syscalls(name: str = "default") -> list[str]:
    """Names of the table that libseccomp could not map on this arch (compiles if needed)."""
    if name not in _SKIPPED:
        compile_policy(name)
    return list(_SKIPPED.get(name, []))


def _valid_prog(prog: bytes) -> bool:
    # Non-empty, whole instructions, within the kernel limit, and ending in BPF_RET (class 0x06):
    # a truncated-but-aligned file would otherwise only be caught by the kernel.
    return (
        0 < len(prog) <= _BPF_MAXINSNS * 8
        and len(prog) % 8 == 0
        and prog[-8] & 0x07 == 0x06
    )


def load_bpf(prog: bytes) -> None:
    """Install ``prog`` for the calling thread (flags=0). no_new_privs must already be set."""
    if not _valid_prog(prog):
        raise ValueError("not a BPF program (empty, misaligned, too long or no final RET)")
    import ctypes  # lazy: ~4 ms, only needed by the process that actually installs the filter

    nr = _SECCOMP_NR.get(os.uname().machine)
    if nr is None or ctypes.sizeof(ctypes.c_void_p) != 8:
        raise OSError(errno.ENOSYS, "seccomp loading is only implemented for 64-bit x86_64/aarch64")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(0),
        ctypes.c_void_p(ctypes.addressof(fprog)),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def default_cache_dir() -> str:
    from .cgroups import caller_uid  # the real caller, also inside the CLI's user namespace

    if caller_uid() == 0:
        return "/var/cache/sandboxrun"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sandboxrun")


class PolicyUnavailable(OSError):
    """The filter could not be compiled on this host (libseccomp missing or unloadable)."""


def _sha256_hex(data: bytes) -> str:
    # The builtin module avoids hashlib's ~4 ms OpenSSL load on the warm-cache path.
    try:
        from _sha256 import sha256  # type: ignore[import-not-found]  # CPython <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # type: ignore[import-not-found,no-redef]  # CPython >= 3.12
        except ImportError:
            from hashlib import sha256  # type: ignore[no-redef]
    return sha256(data).hexdigest()


def _compiler_source() -> str:
    """This module's own text: the compiler (the prologue, which rules go in it) is part of
    what a cached program was built by, and a change to it must not find an old program
    (POLICY_VERSION, bumped by hand, was the only guard)."""
    try:
        with open(__file__, "rb") as f:
            return _sha256_hex(f.read())
    except OSError:  # (installed without sources)
        return ""


def cache_key(name: str = "default") -> str:
    material = "\0".join(
        [
            str(POLICY_VERSION),
            name,
            os.uname().machine,
            "\n".join(describe_policy(name)),
            repr(sorted(_UNIFIED_NR.items())),
            _compiler_source(),
        ]
    )
    return _sha256_hex(material.encode())


def _trusted(st: os.stat_result, kind: int) -> bool:
    return (
        stat.S_IFMT(st.st_mode) == kind
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _open_cache_dir(path: str) -> int | None:
    """fd of a trusted cache dir (created 0700 if absent), or None: never follow a symlinked dir."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # e.g. a missing ~/.cache
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # existing (or a symlink / non-dir): judged below on the opened fd
    except OSError:
        return None  # read-only FS, ENOTDIR, EACCES: run without a disk cache
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not _trusted(os.fstat(fd), stat.S_IFDIR):
        os.close(fd)
        return None
    return fd


def _read_cached(dfd: int, fname: str) -> bytes | None:
    try:
        # O_NONBLOCK: a FIFO planted under the name must not hang us (fstat then rejects it).
        fd = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _trusted(st, stat.S_IFREG) or st.st_size > _BPF_MAXINSNS * 8:
            return None
        data = os.read(fd, st.st_size + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if _valid_prog(data) else None


def _write_cached(dfd: int, fname: str, prog: bytes) -> None:
    tmp = f".{fname}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
    except OSError:
        return  # read-only FS, full disk, ...: the caller still gets the compiled bytes
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prog)
            f.flush()
            os.fsync(f.fileno())
        # Atomic: readers see the old file or the complete new one (also replaces a rejected file).
        os.replace(tmp, fname, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass


def prune_cache(dfd: int, keep: int, match: "Callable[[str], bool]") -> None:
    """In a cache dir, remove the entries `match` selects but the `keep` newest (by mtime)."""
    entries = []
    for e in os.listdir(dfd):
        if match(e):
            try:
                entries.append((os.stat(e, dir_fd=dfd, follow_symlinks=False).st_mtime_ns, e))
            except OSError:
                pass
    for _, e in sorted(entries, reverse=True)[keep:]:
        try:
            os.unlink(e, dir_fd=dfd)
        except OSError:
            pass


def cached_bpf(name: str = "default", *, cache_dir: str | None = None) -> bytes:
    """compile_policy(name), memoised per process and cached on disk under a content key.

    An untrusted cache dir/file (symlink, wrong owner, group/world-writable, bad length) is ignored
    and the program is rebuilt in memory.
    """
    _check_name(name)
    if name in _memo:
        return _memo[name]
    if not _POLICY_RULES[name]:
        _memo[name] = b""
        return b""
    fname = f"seccomp-{name}-{cache_key(name)[:16]}.bpf"
    dfd = _open_cache_dir(cache_dir or default_cache_dir())
    try:
        prog = _read_cached(dfd, fname) if dfd is not None else None
        if prog is None:
            prog = compile_policy(name)
            if dfd is not None:
                _write_cached(dfd, fname, prog)
    finally:
        if dfd is not None:
            os.close(dfd)
    _memo[name] = prog
    return prog
