"""What a one-machine run's raylet starts in place of Ray's dashboard agent (`ray_head._one_machine_head`).

    python -S -I ray_agent_stand_in.py --node-id=<hex> --session-dir=<dir> [Ray's other agent flags, ignored]

A local head started without the dashboard has no reader for anything the dashboard agent serves: no API server
asks its job, log or reporter modules, no Prometheus scrapes its metrics. Ray's raylet still needs an agent
process (it refuses an empty command), waits for the agent's three port files before it registers its node, and
ends itself if the agent exits. This process does exactly that much: it writes -1 ("service not in use", what Ray's
own agent writes for a server it does not start) to the three port files, then waits, doing nothing, until the raylet
that started it is gone. Ray's agent, in the same place, loads its seven modules (an event poller that asks for the
dashboard's address every second, a resource reporter, a log server) and holds ~77 MiB of private memory; this holds
~3 MiB. Run with `-S -I`: it imports nothing beyond the interpreter's own modules.

The runtime-env agent is Ray's own: the raylet asks it to build any actor's `runtime_env` and exits when it does not
answer.
"""

from __future__ import annotations

import os
import sys
import time

PORT_FILES = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
"""The files Ray's raylet waits for, `<session dir>/<name>_<node id>` (ray._raylet.get_port_filename), each
holding one port number."""


def main(argv: list[str]) -> None:
    options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    for name in PORT_FILES:
        path = os.path.join(options["session-dir"], f"{name}_{options['node-id']}")
        with open(path + ".tmp", "w") as file:
            file.write("-1")
        os.replace(path + ".tmp", path)  # whole or absent: the raylet reads it while it polls
    raylet = os.getppid()
    while os.getppid() == raylet:  # reparented: the raylet has exited
        time.sleep(1.0)


if __name__ == "__main__":
    main(sys.argv[1:])
