#!/usr/bin/env python3
"""Checks that every pyx/gradsync/gs_*.pxd mirrors its C header.

Each .pxd is Cython's view of one header in include/. Cython trusts that view:
a struct declared with a field missing still compiles, and the binding then
fills part of a struct whose `size` says it has more (the bug that left
gs_config_t.direct_bytes uninitialized). This script turns the view into C
and lets the compiler compare it with the header:

- every struct the .pxd declares with fields: each field has the header's
  type, the fields are in the header's order with no field skipped (each one
  starts where the previous one ends, after alignment), and the last one
  ends where the struct does;
- every function: the header's prototype, parameter by parameter;
- every enum constant and function-pointer typedef: the header's;
- the other way round: every GS_API function and every enum constant of the
  header is declared in its .pxd.

Usage: check_pxd.py [--cc MPICC] [--keep FILE]; exit status 1 on a
difference, with the compiler's message naming the declaration.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PXD_DIR = os.path.join(TOP, "pyx", "gradsync")
INCLUDE = os.path.join(TOP, "include")

EXTERN = re.compile(r'^cdef extern from "([^"]+)"')
STRUCT = re.compile(r"^\s+ctypedef struct (\w+)\s*:")
ENUM = re.compile(r"^\s+ctypedef enum (\w+)\s*:")
FNPTR = re.compile(r"^\s+ctypedef (.+?)\(\*(\w+)\)\((.*)\)(.*)$")
CNAME = re.compile(r'\s"[^"]*"')


def c_params(params):
    """A Cython parameter list as a C one: () is (void)."""
    params = params.strip()
    return params if params else "void"


def c_type(decl):
    """Drops Cython-only words from a declaration."""
    decl = re.sub(r"\b(noexcept|nogil|except\s*[-\w*?]+)\b", " ", decl)
    return " ".join(decl.split())


def logical_lines(lines):
    """Joins continuation lines (open parentheses) into one."""
    out, buf, depth = [], "", 0
    for raw in lines:
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            if not buf:
                out.append("")
            continue
        buf = buf + " " + line.strip() if buf else line
        depth += line.count("(") - line.count(")")
        if depth <= 0:
            out.append(buf)
            buf, depth = "", 0
    return out


def parse_pxd(path):
    """[(header, structs, enums, functions, fnptrs)] for each extern block."""
    blocks = []
    lines = logical_lines(open(path).read().splitlines())
    i = 0
    while i < len(lines):
        m = EXTERN.match(lines[i])
        i += 1
        if not m:
            continue
        block = {"header": m.group(1), "structs": {}, "enums": {}, "functions": [],
                 "fnptrs": []}
        while i < len(lines) and (not lines[i] or lines[i].startswith(" ")):
            line = CNAME.sub("", lines[i])
            i += 1
            if not line.strip():
                continue
            sm, em = STRUCT.match(line), ENUM.match(line)
            if sm or em:
                members = []
                while i < len(lines) and (not lines[i] or lines[i].startswith("        ")):
                    if lines[i].strip() and lines[i].strip() != "pass":
                        members.append(CNAME.sub("", lines[i]).strip())
                    i += 1
                if sm and members:
                    block["structs"][sm.group(1)] = [split_decl(f) for f in members]
                elif em:
                    block["enums"][em.group(1)] = members
                continue
            fm = FNPTR.match(line)
            if fm:
                block["fnptrs"].append((fm.group(2), c_type(fm.group(1)),
                                        c_params(fm.group(3))))
                continue
            if line.strip().startswith("ctypedef"):
                continue  # opaque typedefs: nothing to compare
            fn = re.match(r"^\s+(.+?\W)(\w+)\s*\((.*)\)(.*)$", line)
            if fn:
                block["functions"].append((fn.group(2), c_type(fn.group(1)),
                                           c_params(c_type(fn.group(3)))))
        blocks.append(block)
    return blocks


def split_decl(decl):
    """'const char *name' -> ('const char *', 'name'); arrays keep their size."""
    m = re.match(r"^(.*?)(\w+)\s*(\[[^\]]*\])?$", decl.strip())
    if not m:
        raise SystemExit(f"check_pxd: cannot read the field declaration {decl!r}")
    base, name, array = m.group(1).strip(), m.group(2), m.group(3) or ""
    return base + (" " + array if array else ""), name


def header_names(header):
    """The GS_API functions and enum constants a public header declares."""
    text = open(os.path.join(INCLUDE, header)).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    functions = re.findall(r"GS_API[^;(]*?\b(\w+)\s*\(", text)
    constants = []
    for body in re.findall(r"typedef enum \w*\s*\{(.*?)\}", text, flags=re.S):
        constants += re.findall(r"^\s*(\w+)\s*(?:=|,|$)", body, flags=re.M)
    return functions, constants


def field_type(struct, field):
    return f"__typeof__((({struct} *)0)->{field})"


def struct_checks(struct, fields, where):
    out = []
    prev = None
    for ctype, name in fields:
        if "[" in ctype:
            base, array = ctype.split("[", 1)
            want = f"{base.strip()}[{array}"
            want = f"__typeof__({base.strip()}[{array.rstrip(']')}])"
        else:
            want = ctype
        out.append(f'_Static_assert(__builtin_types_compatible_p({field_type(struct, name)}, '
                   f'{want}), "{where}: {struct}.{name} has another type in the header");')
        if prev is None:
            out.append(f'_Static_assert(offsetof({struct}, {name}) == 0, '
                       f'"{where}: {struct}.{name} is not the header\'s first field");')
        else:
            out.append(
                f"_Static_assert(offsetof({struct}, {name}) == GS_ALIGN_UP(offsetof({struct}, "
                f"{prev}) + sizeof({field_type(struct, prev)}), "
                f"_Alignof({field_type(struct, name)})), "
                f'"{where}: {struct}: a field the header has between {prev} and {name} is '
                f'missing, or the order differs");')
        prev = name
    out.append(f"_Static_assert(sizeof({struct}) == GS_ALIGN_UP(offsetof({struct}, {prev}) + "
               f"sizeof({field_type(struct, prev)}), _Alignof({struct})), "
               f'"{where}: {struct}: the header has fields after {prev} that the .pxd lacks");')
    return out


def generate(pxds):
    out = ["/* Generated by scripts/check_pxd.py: the .pxd files' view of the C API,",
           " * checked against the headers by the compiler. Do not edit. */",
           "#include <stddef.h>", "#include <stdint.h>", "#include <gradsync.h>",
           "#define GS_ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))", ""]
    problems = []
    uses = []
    for pxd in pxds:
        where = os.path.relpath(pxd, TOP)
        for block in parse_pxd(pxd):
            header = block["header"]
            if not os.path.exists(os.path.join(INCLUDE, header)):
                continue  # mpi.h and other foreign headers
            out.append(f"/* {where} <-> include/{header} */")
            for struct, fields in block["structs"].items():
                out += struct_checks(struct, fields, where)
            for name, ret, params in block["functions"]:
                out.append(f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), "
                           f"{ret} (*)({params})), "
                           f'"{where}: {name} has another prototype in the header");')
            for name, ret, params in block["fnptrs"]:
                out.append(f"_Static_assert(__builtin_types_compatible_p({name}, "
                           f"{ret} (*)({params})), "
                           f'"{where}: {name} is another function type in the header");')
            for enum, constants in block["enums"].items():
                uses += [f"  (void)({c} == ({enum})0);" for c in constants]
            functions, constants = header_names(header)
            declared = {f[0] for f in block["functions"]}
            enum_constants = {c for cs in block["enums"].values() for c in cs}
            problems += [f"{where}: {header} declares {f} but the .pxd does not"
                         for f in functions if f not in declared]
            problems += [f"{where}: {header} defines the constant {c} but the .pxd does not"
                         for c in constants if c not in enum_constants]
    out += ["", "void gs_pxd_check_constants(void);", "void gs_pxd_check_constants(void) {"]
    out += uses + ["}", ""]
    return "\n".join(out), problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default=os.environ.get("MPICC") or shutil.which("mpicc") or "mpicc")
    ap.add_argument("--keep", help="also write the generated C file here")
    args = ap.parse_args()
    pxds = sorted(os.path.join(PXD_DIR, f) for f in os.listdir(PXD_DIR)
                  if f.startswith("gs_") and f.endswith(".pxd"))
    source, problems = generate(pxds)
    if args.keep:
        with open(args.keep, "w") as f:
            f.write(source)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pxd_check.c")
        with open(path, "w") as f:
            f.write(source)
        r = subprocess.run([args.cc, "-std=gnu11", "-fsyntax-only", "-I" + INCLUDE, path],
                           capture_output=True, text=True)
    if r.returncode != 0:
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        problems += errors or [r.stderr.strip()]
    for p in problems:
        print("check_pxd:", p)
    if problems:
        return 1
    print(f"check_pxd: {len(pxds)} .pxd files mirror their headers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
