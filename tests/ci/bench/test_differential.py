from ci.bench import differential


def test_when_the_cost_is_read_then_the_four_parts_split_the_recorded_cell_time():
    figures = differential.cost()
    assert len(figures["parts"]) == differential.PARTS
    assert abs(sum(figures["parts"]) - figures["cell_seconds"]) < 1.0, figures
    assert figures["rows_timed"] <= figures["rows"]


def test_when_the_page_is_written_then_it_quotes_the_recorded_figures():
    figures = {"record_at": "then", "cells": 3, "releases": 2, "rows": 6, "rows_timed": 6, "cell_seconds": 7200.0,
               "last_run": {"at": "then", "wall_s": 60.0, "runs": 6, "rows_run": 5, "jobs": 2, "rows_per_hour": 300,
                            "nice": 0},
               "parts": [1800.0, 1800.0, 1800.0, 1800.0]}
    text = "\n".join(differential.page_lines(figures))
    assert "6 rows (5 run" in text and "300 rows per hour" in text and "7200.0 s (2.00 CPU-hours" in text
    assert "1800.0 s, 1800.0 s, 1800.0 s, 1800.0 s" in text
