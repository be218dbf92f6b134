"""What a run prints, as the launchers show it (``launch/run_output.py``): the notices a
user cannot act on left out of the echo, and the whole stream saved beside the results."""

from __future__ import annotations

from launch.run_output import RUN_LOG, Echo, is_noise, save_run_log


def test_flowers_notices_and_empty_log_lines_are_left_out_of_the_echo():
    assert is_noise("\x1b[92mINFO \x1b[0m:      ")  # Flower's empty line, coloured
    assert is_noise("INFO :")
    assert is_noise("INFO :      Successfully installed pflower to /tmp/x")
    assert not is_noise("INFO :      [round 1/3] training")
    assert not is_noise("")  # a blank line of the run's own


def test_what_ray_workers_print_once_the_results_are_written_is_left_out_of_the_echo():
    """A worker killed as Flower terminates its actors can abort with a C++ stack (seen in a
    clean run of the demo); before the results are written a worker's line is the run's."""
    stream = ["\x1b[36m(ClientAppActor pid=7) \x1b[0mpflower: warning: client 3 has no data\n",
              "INFO :      [final] wrote to outputs/x: results.json\n",
              "INFO :      Manually terminating ClientAppActor\n",
              "(pid=26443) [mutex.cc : 452] RAW: Lock blocking 0x560a1da8d200\n",
              "\x1b[36m(pid=26443)\x1b[0m *** SIGABRT received at time=1796667213 on cpu 1 ***\n",
              "(ClientAppActor pid=26444) Fatal Python error: Aborted\n",
              "INFO :      a line of Flower's own after the results\n"]
    echo = Echo()
    assert [line for line in stream if echo.shows(line)] == [stream[0], stream[1], stream[-1]]


def test_what_rays_pooled_workers_print_is_left_out_of_the_echo_at_any_time():
    """A worker hosting no actor runs none of the run's code; Ray stops idle ones mid-run, and
    one can abort as it stops (the stack that reached a clean demo's echo in CI). An actor's
    line before the results is the run's and stays."""
    stream = ["INFO :      [round 1/3] training\n",
              "(pid=7711) [mutex.cc : 452] RAW: Lock blocking 0x558d29cb4ed0\n",
              "\x1b[36m(pid=7711)\x1b[0m *** SIGABRT received at time=1796678261 on cpu 0 ***\n",
              "(pid=7711) Fatal Python error: Aborted\n",
              "(ClientAppActor pid=7712) pflower: warning: client 3 has no data\n",
              "INFO :      [round 2/3] training\n"]
    echo = Echo()
    assert [line for line in stream if echo.shows(line)] == [stream[0], stream[4], stream[5]]


def test_the_whole_stream_is_saved_in_the_folder_the_first_line_names(tmp_path):
    output = (f"INFO :      [start] method fedavg on digits (cpu), results in {tmp_path}\n"
              "INFO :      [final] wrote to ...\n")
    assert save_run_log(output) == tmp_path / RUN_LOG
    assert (tmp_path / RUN_LOG).read_text() == output
    assert save_run_log("INFO :      [round 1/3] training\n") is None  # it never said
    gone = f"INFO :      [start] method fedavg on digits (cpu), results in {tmp_path / 'x' / 'y'}\n"
    assert save_run_log(gone) is None  # the folder cannot be written to: nothing lost
