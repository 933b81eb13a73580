"""benchmarks/diag_gemv_timeline.py: its copy of moe_gemv keeps up with moe_gemv (the anchors its stamps go by)."""
from benchmarks import diag_gemv_timeline as timeline


def test_every_stamp_finds_its_line_in_moe_gemv_and_the_traced_copy_takes_the_stamps():
    source = timeline.traced_source()  # raises, naming the line, where moe_gemv lost one
    assert source.count("= cycles()") == len(timeline.STAMPS) + 1  # and the call's end
    assert "def traced_gemv(" in source and "do_reduce, nth, stamps):" in source and "cache=True" not in source
