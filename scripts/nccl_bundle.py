"""The carried NCCL (scripts/build_nccl.sh, issue 50): check what a library
is, and unpack the bundle on the device machine.

    python scripts/nccl_bundle.py check LIB [--arch 90] [--min-version 23000]
    python scripts/nccl_bundle.py unpack BUNDLE_DIR DEST_DIR

`check` prints the MANIFEST lines (version, architectures) and fails when
the version is older than asked, or the library lacks machine code for the
architecture asked for, or holds PTX (the driver would compile it at every
start). The
architectures are read from the library's fatbinary section, whose entry
headers stay uncompressed when the payloads are compressed (nvcc
-Xfatbin -compress-all): no cuobjdump needed, which the build machine lacks.
`unpack` decompresses libnccl.so.2.xz with Python's lzma (the device image
may have no xz), checks the bytes against the MANIFEST's sha1, and prints
the library's path.
"""
import argparse
import ctypes
import hashlib
import lzma
import os
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "sm"}  # an entry's payload: PTX text, or machine code (ELF)


def fatbin_section(path):
    """The bytes of the ELF's .nv_fatbin section (64-bit little-endian ELF)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        name, _type, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", data,
                                                                    shoff + i * shentsize)
        return name, off, size
    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name:end] == b".nv_fatbin":
            return data[off:off + size]
    raise ValueError(f"{path}: no .nv_fatbin section (no GPU code)")


def architectures(path):
    """{"sm_90", "ptx_90", ...}: one name per kind and architecture found."""
    sec, found, pos = fatbin_section(path), set(), 0
    while pos + 16 <= len(sec):
        magic, _version, header, size = struct.unpack_from("<IHHQ", sec, pos)
        if magic != FATBIN_MAGIC:  # padding between the fatbinaries of objects
            pos += 8
            continue
        entry, end = pos + header, pos + header + size
        while entry + 32 <= end:
            kind, _ev, eheader, padded = struct.unpack_from("<HHII", sec, entry)
            arch, = struct.unpack_from("<I", sec, entry + 28)
            found.add(f"{KIND.get(kind, f'kind{kind}_')}_{arch}")
            if eheader == 0:
                break
            entry += eheader + padded
        pos = end
    return found


def nccl_version(path):
    lib = ctypes.CDLL(path)
    v = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(v)) != 0:
        raise RuntimeError(f"{path}: ncclGetVersion failed")
    return v.value


def check(args):
    version = nccl_version(args.lib)
    text = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    print(f"version {text} ({version})")
    problems = []
    if version < args.min_version:
        problems.append(f"version {version} is older than {args.min_version}")
    if args.arch:
        archs = architectures(args.lib)
        print(f"architectures {','.join(sorted(archs))}", flush=True)
        # NCCL compiles a few kernels for its own targets whatever it is
        # asked (its Blackwell-only fp8 kernels: sm_100): reported above,
        # not refused; what must hold is machine code for the GPU asked for
        # and no PTX, which the driver would compile at every start
        if f"sm_{args.arch}" not in archs or any(a.startswith("ptx") for a in archs):
            problems.append(f"GPU code for {sorted(archs)}: want sm_{args.arch} machine code "
                            f"and no PTX")
    for p in problems:
        print(f"nccl_bundle.py: {args.lib}: {p}", file=sys.stderr)
    return 1 if problems else 0


def unpack(args):
    src = os.path.join(args.bundle, "libnccl.so.2.xz")
    os.makedirs(args.dest, exist_ok=True)
    dest = os.path.join(args.dest, "libnccl.so.2")
    with lzma.open(src) as f, open(dest + ".tmp", "wb") as out:
        while chunk := f.read(1 << 22):
            out.write(chunk)
    want = manifest(args.bundle).get("sha1")
    if want and sha1(dest + ".tmp") != want:
        os.remove(dest + ".tmp")
        print(f"nccl_bundle.py: {src} unpacks to other bytes than its MANIFEST's sha1",
              file=sys.stderr)
        return 1
    os.replace(dest + ".tmp", dest)
    print(dest)
    return 0


def manifest(bundle):
    """The MANIFEST's "key value" lines as a dict."""
    with open(os.path.join(bundle, "MANIFEST")) as f:
        return dict(line.rstrip("\n").split(" ", 1) for line in f if " " in line)


def sha1(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("lib")
    c.add_argument("--arch", type=int, default=90, help="0: do not check architectures")
    c.add_argument("--min-version", type=int, default=23000)
    u = sub.add_parser("unpack")
    u.add_argument("bundle")
    u.add_argument("dest")
    args = p.parse_args(argv)
    return check(args) if args.cmd == "check" else unpack(args)


if __name__ == "__main__":
    sys.exit(main())
