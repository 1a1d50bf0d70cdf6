"""``placement.backend=ray`` against real Ray clusters on loopback: a bad address, a recipe that
asks for more than the cluster has and engines that cannot be placed each give one error
before anything starts; a cluster started with ``ray start --head`` is joined, used and left
with nothing of the run's in it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.test_recipe_errors import build_error

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

FLEET = ["engines=[{kind: server, replicas: 2}]", "weights.transport=broadcast", "placement.backend=ray"]


def test_engines_in_the_driver_process_cannot_be_placed(tmp_path: Path) -> None:
    msg = build_error(tmp_path, ["placement.backend=ray"])  # tiny-terminal's embedded engine
    assert "engines.0.kind='embedded'" in msg and "engines.0.kind=server" in msg
    assert not ray.is_initialized()  # refused before joining any cluster


def test_an_address_where_no_cluster_answers_is_one_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    msg = build_error(tmp_path, [*FLEET, f"placement.ray.address=127.0.0.1:{port}",
                                 "placement.ray.connect_timeout_s=2"])
    assert f"placement.ray.address='127.0.0.1:{port}'" in msg and "nothing answers" in msg
    assert not (tmp_path / "run" / "engines").exists()


def test_more_than_the_cluster_has_names_the_component_and_resource(tmp_path: Path) -> None:
    temp = Path(f"/tmp/mr-{os.getpid()}")
    # unset reservations shrink to fit (test_unset_reservations_fit_the_cluster_they_find); a set one is kept
    msg = build_error(tmp_path, ["engines=[{kind: server, replicas: 3}]", "weights.transport=broadcast",
                                 "placement.backend=ray", "placement.ray.num_cpus=2", f"placement.ray.temp_dir={temp}",
                                 "placement.ray.engine_resources={CPU: 1}"])
    assert "engines.0 (server, 3 replica(s)) asks for CPU: 1 x 3" in msg and "has 2 CPU" in msg, msg
    assert "lower placement.ray.engine_resources" in msg, msg
    assert not (tmp_path / "run" / "engines" / "server-0").exists()  # no engine was started
    assert not ray.is_initialized()
    shutil.rmtree(temp, ignore_errors=True)


def _listeners_off_loopback(pids: list[int]) -> list[str]:
    import ipaddress

    bad = []
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                if conn.status != psutil.CONN_LISTEN:
                    continue
                addr = ipaddress.ip_address(conn.laddr.ip)
                addr = getattr(addr, "ipv4_mapped", None) or addr
                if not addr.is_loopback:
                    bad.append(f"pid {pid} on {conn.laddr.ip}:{conn.laddr.port}")
        except psutil.Error:
            continue
    return bad


JOIN = r"""
import json, sys
from miles_engine.cluster.config import RayOptions
from miles_engine.cluster.ray_cluster import RayCluster
from miles_engine.cluster.trainer_ranks import RankHost

cluster = RayCluster(RayOptions(address=sys.argv[1], namespace="miles-test"), prefix="miles-joined").connect()
ray = cluster.ray
pg = cluster.placement_group([{"CPU": 1}], name="miles-joined-trainer")
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
actor = cluster.track(ray.remote(RankHost).options(name="miles-joined-trainer-rank0", num_cpus=1,
    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)).remote())
host, port = ray.get(actor.rendezvous.remote(), timeout=60)
print(json.dumps({"named": sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)),
                  "host": host, "metrics": cluster.metrics()}), flush=True)
cluster.shutdown()
"""


@pytest.mark.timeout(300)
def test_a_running_cluster_is_joined_and_left_clean(tmp_path: Path) -> None:
    """``ray start --head`` on loopback (2 CPUs); the run places a rank actor there and leaves."""
    temp = Path(f"/tmp/rh-{os.getpid()}")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    start = subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                            "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                           capture_output=True, text=True, env=env, timeout=120)
    try:
        assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
        head = [p.pid for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or ())]
        assert head and not _listeners_off_loopback(head)
        joined = subprocess.run([sys.executable, "-c", JOIN, f"127.0.0.1:{port}"], capture_output=True, text=True,
                                env=env, timeout=180)
        assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-3000:]
        seen = json.loads(joined.stdout.strip().splitlines()[-1])
        assert "miles-joined-trainer-rank0" in seen["named"] and seen["host"] == "127.0.0.1"
        assert seen["metrics"]["ray/actors"] == 1 and seen["metrics"]["ray/placement_groups"] == 1
        check = subprocess.run([sys.executable, "-c",
                                "import ray, json, sys, time\n"
                                "ray.init(address=sys.argv[1], log_to_driver=False)\n"
                                "deadline = time.time() + 30\n"
                                "while True:\n"
                                "    names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)]\n"
                                "    pgs = [p for p in ray.util.placement_group_table().values() if p['state'] != 'REMOVED']\n"
                                "    if not (names or pgs) or time.time() > deadline: break\n"
                                "    time.sleep(0.5)\n"
                                "print(json.dumps({'names': names, 'pgs': len(pgs)}))",
                                f"127.0.0.1:{port}"], capture_output=True, text=True, env=env, timeout=120)
        assert check.returncode == 0, check.stderr[-2000:]
        assert json.loads(check.stdout.strip().splitlines()[-1]) == {"names": [], "pgs": 0}  # nothing of ours stays
    finally:  # stop this head only (`ray stop` would stop every Ray of the machine)
        head = [p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or ())]
        for proc in head:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(head, timeout=20)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_at_load() -> None:
    from tests.run.test_recipe_errors import load_error

    msg = load_error(["placement.backend=ray", f"placement.ray.temp_dir=/tmp/{'x' * 40}"])
    assert "placement.ray.temp_dir is 45 characters long" in msg and "at most 42" in msg


def test_components_too_big_only_together_are_all_named() -> None:
    """The resource check alone (no cluster): each component fits, all of them together do not."""
    from miles_engine.cluster.config import RayOptions
    from miles_engine.cluster.ray_cluster import Demand, RayCluster
    from miles_engine.errors import ConfigError

    class TwoCPUs:
        @staticmethod
        def cluster_resources() -> dict[str, float]:
            return {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0}

    cluster = RayCluster(RayOptions(), ray=TwoCPUs())
    demands = [Demand("engines.0 (server, 2 replica(s))", {"CPU": 0.5}, 2),
               Demand("the trainer (trainer.parallel.world_size=1 rank(s))", {"CPU": 1.0}, 1, "trainer_resources"),
               Demand("the episode runners (placement.ray.episode_runners=2)", {"CPU": 1.0}, 2, "runner_resources")]
    with pytest.raises(ConfigError) as err:
        cluster.check_resources(demands)
    msg = str(err.value)
    assert msg.startswith("the run needs 4 CPU in all (engines.0 (server, 2 replica(s)) asks for CPU: 0.5 x 2"), msg
    assert "the episode runners (placement.ray.episode_runners=2) asks for CPU: 1 x 2 bundle(s)" in msg
    assert "has 2 CPU (CPU: 2, memory: 1e+09)" in msg
    assert "placement.ray.engine_resources, placement.ray.trainer_resources, placement.ray.runner_resources" in msg
    cluster.check_resources(demands[:2])  # 2 CPU: fits


def test_session_server_actors_are_counted_in_the_resource_check() -> None:
    """placement.ray.session_servers adds one demand naming it; too many fail before anything starts."""
    from miles_engine.cluster.placement import RayPlacement
    from miles_engine.config.recipe import load_recipe
    from miles_engine.engines.fleet.build import create_kinds
    from miles_engine.errors import ConfigError
    from miles_engine.hub import default_hub

    cfg = load_recipe("tiny-terminal", ["placement.backend=ray", "engines=[{kind: server, replicas: 2}]",
                                        "weights.transport=broadcast", "placement.ray.session_servers=3",
                                        "placement.ray.session_server_resources={CPU: 2}"], hub=default_hub())
    placement = RayPlacement(cfg, create_kinds(default_hub(), cfg.engines))
    demand = placement.demands()[-1]
    assert (demand.component, demand.resources, demand.bundles, demand.key) == (
        "the session servers (placement.ray.session_servers=3)", {"CPU": 2.0}, 3, "session_server_resources")

    class FourCPUs:
        @staticmethod
        def cluster_resources() -> dict[str, float]:
            return {"CPU": 4.0}

    placement.cluster.ray = FourCPUs()
    with pytest.raises(ConfigError) as err:
        placement.cluster.check_resources(placement.demands())
    assert str(err.value).startswith("the session servers (placement.ray.session_servers=3) asks for CPU: 2 x 3"), err
    assert "placement.ray.session_server_resources" in str(err.value)
    off = load_recipe("tiny-terminal", ["placement.backend=ray", "engines=[{kind: server, replicas: 2}]",
                                        "weights.transport=broadcast"], hub=default_hub())
    assert off.placement.ray.session_servers == 0  # the default: the driver's session server
    assert not any("session servers" in d.component for d in RayPlacement(off, create_kinds(
        default_hub(), off.engines)).demands())


def test_unset_reservations_fit_the_cluster_they_find() -> None:
    """The defaults ask 1 CPU per actor; on a cluster too small for that (2 CPUs: one engine, one
    trainer rank, two episode runners) every unset reservation gets an equal share of what the set
    ones leave, so `placement.backend=ray` runs as shipped; set ones are kept as given."""
    from miles_engine.cluster.placement import RayPlacement, fit_cpus
    from miles_engine.cluster.ray_cluster import RayCluster
    from miles_engine.config.recipe import load_recipe
    from miles_engine.engines.fleet.build import create_kinds
    from miles_engine.errors import ConfigError
    from miles_engine.hub import default_hub

    counts = {"engine_resources": 1, "trainer_resources": 1, "runner_resources": 2}
    unset = dict.fromkeys(counts)
    assert fit_cpus(counts, unset, 8.0) == {k: {"CPU": 1.0} for k in counts}  # room: 1 CPU each
    assert fit_cpus(counts, unset, 2.0) == {k: {"CPU": 0.5} for k in counts}
    three = fit_cpus(counts, {**unset, "trainer_resources": {"CPU": 1.0}}, 2.0)
    assert three["trainer_resources"] == {"CPU": 1.0} and three["engine_resources"] == {"CPU": 0.3333}
    assert fit_cpus(counts, {**unset, "trainer_resources": {"CPU": 4.0}}, 2.0)["runner_resources"] == {"CPU": 1.0}

    class TwoCPUs:
        @staticmethod
        def cluster_resources() -> dict[str, float]:
            return {"CPU": 2.0}

    def placed(*overrides: str) -> RayPlacement:
        cfg = load_recipe("tiny-terminal", ["placement.backend=ray", "engines=[{kind: server}]",
                                            "weights.transport=broadcast", *overrides], hub=default_hub())
        placement = RayPlacement(cfg, create_kinds(default_hub(), cfg.engines))
        placement.cluster = RayCluster(cfg.placement.ray, ray=TwoCPUs())
        placement.resources = fit_cpus(placement.bundle_counts(), {k: getattr(placement.options, k) for k in (
            "engine_resources", "trainer_resources", "runner_resources", "session_server_resources")}, 2.0)
        return placement

    defaults = placed()
    defaults.cluster.check_resources(defaults.demands())  # the shipped defaults fit 2 CPUs
    assert [d.resources for d in defaults.demands()] == [{"CPU": 0.5}] * 3
    too_big = placed("placement.ray.trainer_resources={CPU: 3}")  # one set key that cannot fit: named
    with pytest.raises(ConfigError, match=r"the trainer .* asks for CPU: 3 x 1 bundle\(s\).*placement.ray."
                                          r"trainer_resources"):
        too_big.cluster.check_resources(too_big.demands())
