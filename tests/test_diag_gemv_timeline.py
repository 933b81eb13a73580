"""benchmarks/diag_gemv_timeline.py: its copies of moe_gemv and gemv_member keep up with them (the anchors its stamps go
by)."""
from benchmarks import diag_gemv_timeline as timeline


def test_every_stamp_finds_its_line_and_the_traced_copies_take_the_stamps():
    source = timeline.traced_source()  # raises, naming the line, where moe_gemv or gemv_member lost one
    assert source.count("= cycles()") == len(timeline.GEMV_STAMPS) + len(timeline.MEMBER_STAMPS) + 1  # + the end
    assert "def traced_gemv(" in source and "do_reduce, nth, stamps):" in source and "cache=True" not in source
    assert "def traced_member(" in source and source.count("th, nth, stamps)") == 2  # its def and moe_gemv's call
