"""The backward's 128x1 quantizations (tabby/ops/quantize.py), compiled for sm_90a on a machine without
a GPU: their transposed values leave as 32-bit words (``pack_rows4``), so no byte goes through
shared memory (the byte-by-byte transposes they replaced issued 64-66 such accesses a thread);
the word path's global stores are 32-bit; no spills. Their values: test_fp8_quantize.py."""
import re

from sm90 import Const, compile_args, ptxas_report, run_compiled_check


def _line(name, k):
    ptx, rep = k.asm["ptx"], ptxas_report(k)
    print(name, "shared_b8", len(re.findall(r"(ld|st)\.shared\.[us]?b?8\b", ptx)),
          "global_b8_stores", len(re.findall(r"st\.global\.b8\b", ptx)),
          "global_b32_stores", len(re.findall(r"st\.global\.b32\b", ptx)),
          "spills", sum(int(n) for n in re.findall(r"(\d+) bytes spill", rep)))


def _report():
    from tabby.ops import quantize

    common = dict(qt_ptr="*fp8e4nv", stride_qt="i32:16", s_ptr="*fp32", stride_sm="i32:16", R="i32:16",
                  C="i32:16", row_src_ptr="*i32", num_tiles_ptr="*i32", stride_xm="i32:16",
                  TILE_ROWS=Const(128), PACKED=Const(True), INTERPRET=Const(False))
    # the layer's launches (quantize_cols): E4M3 rows with their 1x128 scales (dy, xs) at 128 columns
    # a program, bf16 rows (hw) at 64
    for name, x, scaled, bc in (("cols/e4m3", "*fp8e4nv", True, 128), ("cols/bf16", "*bf16", False, 64)):
        args = dict(common, x_ptr=x, xs_ptr="*fp32", stride_xsm="i32:16", MASKED=Const(True), BC=Const(bc),
                    ROW_SCALED=Const(scaled))
        _line(name, compile_args(quantize.quantize_cols_kernel, args, num_warps=4))
    args = dict(common, x_ptr="*bf16", q_ptr="*fp8e4nv", stride_qm="i32:16", stride_stm="i32:16", st_ptr="*fp32")
    args.pop("stride_sm")
    args.update(s_ptr="*fp32", stride_sm="i32")
    _line("rows_and_cols/bf16", compile_args(quantize.quantize_rows_cols_kernel, args, num_warps=4))


def test_128x1_quantizations_store_words_without_bytes_through_shared_memory():
    lines = run_compiled_check(__file__).splitlines()
    assert len(lines) == 3, lines
    for line in lines:
        f = line.split()
        c = dict(zip(f[1::2], map(int, f[2::2])))
        assert c["shared_b8"] == 0 and c["global_b8_stores"] == 0, line
        assert c["global_b32_stores"] >= 16 and c["spills"] == 0, line


if __name__ == "__main__":
    _report()
