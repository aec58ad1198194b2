"""How C kernels are named in the build cache (engine.system.native_library): a library is rebuilt when
anything it is built from changes, the local headers its source includes among them."""

from __future__ import annotations

from engine.system import native_library


def test_a_changed_header_names_a_new_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    source, header = tmp_path / "kernel.c", tmp_path / "shared.h"
    source.write_text('#include <stdint.h>\n#include "shared.h"\nint value(void) { return SHARED; }\n')
    header.write_text("#define SHARED 1\n")
    compiler = native_library.compiler()
    first = native_library.library_path(source, ["-O2"], compiler)
    assert native_library.library_path(source, ["-O2"], compiler) == first
    header.write_text("#define SHARED 2\n")
    assert native_library.library_path(source, ["-O2"], compiler) != first
