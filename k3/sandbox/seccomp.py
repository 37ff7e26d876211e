"""The seccomp filter both backends load: a classic-BPF program (as `bwrap --seccomp` and
prctl(PR_SET_SECCOMP) take it) that denies, with EPERM, the syscalls a sandboxed command has no business
making: mounts, ptrace and cross-process memory access, new namespaces (unshare, setns, clone with a
CLONE_NEW* flag), kernel keyrings, bpf, perf, module and kexec loading, TIOCSTI / TIOCLINUX terminal
injection. Any architecture but x86-64 is killed, and x32 syscall numbers are denied."""

from __future__ import annotations

import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
EPERM = 1

RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
RET_KILL_PROCESS = 0x80000000

# x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
DENIED = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "acct": 163,
    "unshare": 272,
    "setns": 308,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "finit_module": 313,
    "perf_event_open": 298,
    "bpf": 321,
    "userfaultfd": 323,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
SYS_CLONE, SYS_CLONE3, SYS_IOCTL = 56, 435, 16
ENOSYS = 38
CLONE_NEW_FLAGS = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00020000
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

# offsets into struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}
OFF_NR, OFF_ARCH, OFF_ARG0, OFF_ARG1 = 0, 4, 16, 24
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def deny_filter() -> bytes:
    """The filter as bytes: 8 bytes per instruction, ready for `bwrap --seccomp FD`."""
    deny = RET_ERRNO | EPERM
    prog = [
        _ins(LD_W_ABS, 0, 0, OFF_ARCH),
        _ins(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _ins(RET_K, 0, 0, RET_KILL_PROCESS),
        _ins(LD_W_ABS, 0, 0, OFF_NR),
        _ins(JGE_K, 0, 1, X32_BIT),
        _ins(RET_K, 0, 0, deny),
    ]
    for nr in sorted(DENIED.values()):  # if nr == N: deny
        prog += [_ins(JEQ_K, 0, 1, nr), _ins(RET_K, 0, 0, deny)]
    # clone3 passes its flags in memory BPF cannot read: ENOSYS makes libc fall back to clone
    prog += [_ins(JEQ_K, 0, 1, SYS_CLONE3), _ins(RET_K, 0, 0, RET_ERRNO | ENOSYS)]
    prog += [  # clone(flags, ...) with any CLONE_NEW* flag
        _ins(JEQ_K, 0, 4, SYS_CLONE),
        _ins(LD_W_ABS, 0, 0, OFF_ARG0),
        _ins(JSET_K, 0, 1, CLONE_NEW_FLAGS),
        _ins(RET_K, 0, 0, deny),
        _ins(RET_K, 0, 0, RET_ALLOW),
    ]
    prog += [  # ioctl(fd, TIOCSTI | TIOCLINUX, ...)
        _ins(JEQ_K, 0, 5, SYS_IOCTL),
        _ins(LD_W_ABS, 0, 0, OFF_ARG1),
        _ins(JEQ_K, 2, 0, TIOCSTI),
        _ins(JEQ_K, 1, 0, TIOCLINUX),
        _ins(RET_K, 0, 0, RET_ALLOW),
        _ins(RET_K, 0, 0, deny),
    ]
    prog.append(_ins(RET_K, 0, 0, RET_ALLOW))
    return b"".join(prog)
