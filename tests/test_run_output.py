"""What a run prints, as the launchers show it (``launch/run_output.py``): the notices a
user cannot act on left out of the echo, and the whole stream saved beside the results."""

from __future__ import annotations

from launch.run_output import RUN_LOG, is_noise, save_run_log


def test_flowers_notices_and_empty_log_lines_are_left_out_of_the_echo():
    assert is_noise("\x1b[92mINFO \x1b[0m:      ")  # Flower's empty line, coloured
    assert is_noise("INFO :")
    assert is_noise("INFO :      Successfully installed pflower to /tmp/x")
    assert not is_noise("INFO :      [round 1/3] training")
    assert not is_noise("")  # a blank line of the run's own


def test_the_whole_stream_is_saved_in_the_folder_the_first_line_names(tmp_path):
    output = (f"INFO :      [start] method fedavg on digits (cpu), results in {tmp_path}\n"
              "INFO :      [final] wrote to ...\n")
    assert save_run_log(output) == tmp_path / RUN_LOG
    assert (tmp_path / RUN_LOG).read_text() == output
    assert save_run_log("INFO :      [round 1/3] training\n") is None  # it never said
    gone = f"INFO :      [start] method fedavg on digits (cpu), results in {tmp_path / 'x' / 'y'}\n"
    assert save_run_log(gone) is None  # the folder cannot be written to: nothing lost
