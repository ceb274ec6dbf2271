#!/usr/bin/env python3
"""Compiles one CUDA C++ file to PTX with NVRTC, loaded from a given libnvrtc.so with ctypes.

Usage: nvrtc_compile.py LIBNVRTC SOURCE OUTPUT [NVRTC OPTION...]

No CUDA toolkit and no GPU are needed: only libnvrtc.so.12 (and the libnvrtc-builtins it
loads from its own directory), as PyPI's nvidia-cuda-nvrtc-cu12 wheel ships them. The program
is named after SOURCE's file name only, so the PTX does not depend on where the tree lives.
The compile log (warnings included) goes to stderr; any warning or error fails.
"""

import ctypes
import os
import sys


def check(nvrtc, result, what):
    if result != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = nvrtc.nvrtcGetErrorString(result).decode()
        raise SystemExit(f"nvrtc_compile: {what} failed: {msg}")


def main(argv):
    if len(argv) < 4:
        raise SystemExit(__doc__)
    lib, source, output, options = argv[1], argv[2], argv[3], argv[4:]
    nvrtc = ctypes.CDLL(lib)

    major, minor = ctypes.c_int(), ctypes.c_int()
    check(nvrtc, nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")

    with open(source, "rb") as f:
        text = f.read()
    prog = ctypes.c_void_p()
    name = os.path.basename(source).encode()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text, name, 0, None, None),
          "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        compiled = nvrtc.nvrtcCompileProgram(prog, len(options), opts)

        size = ctypes.c_size_t()
        check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log = log.value.decode(errors="replace").strip()
        if log:
            sys.stderr.write(log + "\n")
        check(nvrtc, compiled, f"compiling {source} (NVRTC {major.value}.{minor.value})")
        if log:
            raise SystemExit(f"nvrtc_compile: {source}: warnings are errors here")

        check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))

    # ptx.value stops at the terminating NUL.
    with open(output, "wb") as f:
        f.write(ptx.value)


if __name__ == "__main__":
    main(sys.argv)
