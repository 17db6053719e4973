"""Tabby's tools: the benchmark (``tabby bench``), the variant sweep (``tabby tune``), the stage
profile (``tabby profile``), the anchors Tabby is measured against, and the benchmark shapes.

They use the library (``tabby``); the library never imports them. Run them as ``tabby <command>``
or ``python -m tabby_bench <command>``.
"""
