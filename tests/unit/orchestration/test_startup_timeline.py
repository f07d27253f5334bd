"""The start-up line the driver prints when its loop starts (orchestration/train.py StartupTimeline): each part
with the time it was done, from the driver's launch, in the order the parts were done."""

from __future__ import annotations

import asyncio
import re
import time

import psutil

from megatron_rl.orchestration.train import StartupTimeline


def test_parts_are_listed_in_the_order_they_were_done_from_the_launch():
    timeline = StartupTimeline()
    assert abs(timeline.launched - psutil.Process().create_time()) < 1e-6
    timeline.mark("Ray")
    time.sleep(0.02)

    async def ready() -> str:
        return "up"

    assert asyncio.run(timeline.timed(ready(), "engines")) == "up"
    # marked last but done first: a server launched before Ray was up (a run on a cluster marks no such part)
    timeline.mark("engines launched", ago=time.time() - timeline.launched - 0.001)
    line = timeline.line()
    found = re.fullmatch(r"start-up ([0-9.]+) s from launch \((.*)\)", line)
    assert found, line
    names = [item.rsplit(" ", 1)[0] for item in found[2].split(", ")]
    assert names == ["engines launched", "Ray", "engines"]
    assert timeline.marks["Ray"] < timeline.marks["engines"] <= float(found[1]) + 0.05
    assert timeline.marks["engines launched"] < timeline.marks["Ray"]
