"""The plain-text tables: tabulate's `simple` and `github` layouts, by hand."""
from memplan.columns import render_columns


def test_simple_layout_pads_to_the_widest_cell_and_two_past_the_header():
    text = render_columns([["ddp", "backward", " 1.00 "], ["fsdp-full-shard", "optimizer", "-"]],
                          ["strategy", "peak in", "x"])
    assert text == ("strategy         peak in    x\n"
                    "---------------  ---------  ----\n"
                    "ddp              backward   1.00\n"
                    "fsdp-full-shard  optimizer  -")


def test_markdown_layout():
    text = render_columns([["a", ""], ["ccc", "±1.5 %"]], ["id", "error %"], markdown=True)
    assert text == ("| id   | error %   |\n"
                    "|------|-----------|\n"
                    "| a    |           |\n"
                    "| ccc  | ±1.5 %    |")
