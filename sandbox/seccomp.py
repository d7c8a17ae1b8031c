"""The seccomp filter every local-sandbox command runs under: kernel interfaces that graded code
never needs are refused with EPERM, because they are where kernel escapes have come from.

Refused: new namespaces (``unshare``/``clone`` with a namespace flag, ``setns``; ``clone3`` answers
ENOSYS so that libc falls back to ``clone``, whose flags a filter can read), ``mount`` and the new
mount API, keyrings, ``bpf``, ``perf_event_open``, ``userfaultfd``, io_uring, ``ptrace``,
module and kexec loading, file handles (``open_by_handle_at``), swap, reboot, ``acct``, ``quotactl``,
``syslog``, ``vhangup``, ``lookup_dcookie``. A foreign system-call ABI (x32, or another
architecture) kills the process. Everything else is allowed: this is a deny list on top of the
namespaces, rlimits and missing capabilities, not a whitelist.

``build_filter()`` returns the classic-BPF program as bytes (``struct sock_filter[]``); the agent
installs it on the exec's pid 1 after "no new privileges", so the command and all it starts inherit
it. Supported: x86_64 and aarch64.
"""

from __future__ import annotations

import platform
import struct

__all__ = ["DENIED", "build_filter"]

# BPF instruction classes/fields (linux/filter.h, linux/bpf_common.h).
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x05 | 0x30 | 0x00
BPF_JSET_K = 0x05 | 0x40 | 0x00
BPF_RET_K = 0x06 | 0x00
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # args[0]'s low 32 bits (little-endian)
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
X32_SYSCALL_BIT = 0x40000000

ARCHES = {
    # machine: (AUDIT_ARCH_*, {name: number})
    "x86_64": (
        0xC000003E,
        {
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "kexec_load": 246,
            "kexec_file_load": 320,
            "init_module": 175,
            "finit_module": 313,
            "delete_module": 176,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "move_mount": 429,
            "open_tree": 428,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
            "swapon": 167,
            "swapoff": 168,
            "reboot": 169,
            "setns": 308,
            "ptrace": 101,
            "open_by_handle_at": 304,
            "name_to_handle_at": 303,
            "acct": 163,
            "quotactl": 179,
            "syslog": 103,
            "vhangup": 153,
            "lookup_dcookie": 212,
            "unshare": 272,
            "clone": 56,
            "clone3": 435,
        },
    ),  # fmt: skip
    "aarch64": (
        0xC00000B7,
        {
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "kexec_load": 104,
            "kexec_file_load": 294,
            "init_module": 105,
            "finit_module": 273,
            "delete_module": 106,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "move_mount": 429,
            "open_tree": 428,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
            "swapon": 224,
            "swapoff": 225,
            "reboot": 142,
            "setns": 268,
            "ptrace": 117,
            "open_by_handle_at": 265,
            "name_to_handle_at": 264,
            "acct": 89,
            "quotactl": 60,
            "syslog": 116,
            "vhangup": 58,
            "lookup_dcookie": 18,
            "unshare": 97,
            "clone": 220,
            "clone3": 435,
        },
    ),  # fmt: skip
}
DENIED = sorted(set(ARCHES["x86_64"][1]) - {"unshare", "clone", "clone3"})
"""Refused outright (``unshare`` and ``clone`` only with a namespace flag; ``clone3`` with ENOSYS)."""


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None) -> bytes:
    """The filter program for ``machine`` (default: this host's)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"no seccomp filter for {machine!r}; supported: {sorted(ARCHES)}")
    audit_arch, numbers = ARCHES[machine]
    deny = _insn(BPF_RET_K, RET_ERRNO | EPERM)
    prog = [
        _insn(BPF_LD_W_ABS, OFF_ARCH),
        _insn(BPF_JEQ_K, audit_arch, jt=1),
        _insn(BPF_RET_K, RET_KILL_PROCESS),
        _insn(BPF_LD_W_ABS, OFF_NR),
    ]
    if machine == "x86_64":  # the x32 ABI numbers every call again, past this bit
        prog += [_insn(BPF_JGE_K, X32_SYSCALL_BIT, jf=1), _insn(BPF_RET_K, RET_KILL_PROCESS)]
    for name in DENIED:
        prog += [_insn(BPF_JEQ_K, numbers[name], jf=1), deny]
    prog += [_insn(BPF_JEQ_K, numbers["clone3"], jf=1), _insn(BPF_RET_K, RET_ERRNO | ENOSYS)]
    for name in ("clone", "unshare"):
        # nr == name? then load flags (args[0]) and refuse any namespace bit; else next check.
        prog += [
            _insn(BPF_JEQ_K, numbers[name], jf=4),
            _insn(BPF_LD_W_ABS, OFF_ARG0),
            _insn(BPF_JSET_K, NAMESPACE_FLAGS, jt=0, jf=1),
            deny,
            _insn(BPF_RET_K, RET_ALLOW),
        ]
    prog.append(_insn(BPF_RET_K, RET_ALLOW))
    return b"".join(prog)
