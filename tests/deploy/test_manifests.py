"""deploy/: the Kubernetes manifests validate against Kubernetes' own schemas
(kubernetes-validate, strict: an unknown field fails), agree with the sidecar's flags and
each other, and the DaemonSet's init script leaves directories the sidecar, as uid 10001,
starts on and engines in its group (only they) connect through."""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import kubernetes_validate
import pytest
import yaml

from sidecar.cli import parser
from sidecar.config import load, parse_size
from tests.conftest import ROOT

DEPLOY = os.path.join(ROOT, "deploy")
MANIFESTS = sorted(glob.glob(os.path.join(DEPLOY, "*.yaml")))
VERSIONS = ["1.29", kubernetes_validate.latest_version()]


def docs(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def find(kind: str, name: str) -> dict:
    for path in MANIFESTS:
        for d in docs(path):
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
    raise AssertionError(f"no {kind} {name} in deploy/")


def daemonset() -> dict:
    return find("DaemonSet", "kv-sidecar")


def engines() -> list[dict]:
    return [find("Pod", "sglang-qwen3-8b"), find("Pod", "vllm-qwen3-8b")]


def flags(args: list[str]) -> dict:
    """--name=value arguments as {name: value} (the manifests use that form)."""
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def volume(pod_spec: dict, container: dict, mount_path: str) -> dict:
    name = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == mount_path)
    return next(v for v in pod_spec["volumes"] if v["name"] == name)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_manifests_validate_strictly(path, version):
    found = docs(path)
    assert found
    for d in found:
        kubernetes_validate.validate(d, version, strict=True)


def test_the_validator_is_strict():
    """A misspelt field (hostpath for hostPath) fails: the check above would notice one."""
    bad = copy.deepcopy(daemonset())
    vol = bad["spec"]["template"]["spec"]["volumes"][0]
    vol["hostpath"] = vol.pop("hostPath")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_daemonset_agrees_with_the_sidecar_and_the_engines():
    spec = daemonset()["spec"]["template"]["spec"]
    side = spec["containers"][0]
    args = side["args"]
    assert args[0] == "serve"
    parsed = vars(parser().parse_args(args))  # every flag is the sidecar's own
    config = load(
        None, overrides={k: v for k, v in parsed.items() if k not in ("command", "config")}
    )
    f = flags(args)
    assert config.port == int(f["port"]) == side["ports"][0]["containerPort"]
    meta = daemonset()["spec"]["template"]["metadata"]["annotations"]
    assert meta["prometheus.io/port"] == f["port"] and meta["prometheus.io/path"] == "/metrics"
    # the pool fits the memory limit; the socket and data dir are the hostPath volumes
    assert config.host_pool + 2**30 <= parse_size(
        side["resources"]["limits"]["memory"].replace("Gi", "GiB")
    )
    sock_dir = os.path.dirname(config.socket)
    run = volume(spec, side, sock_dir)["hostPath"]
    assert volume(spec, side, config.data_dir)["hostPath"]["type"] == "DirectoryOrCreate"
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "/readyz" in " ".join(side["readinessProbe"]["exec"]["command"])
    assert side["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "kv-sidecar-token"
    gid = spec["securityContext"]["runAsGroup"]
    for pod in engines():
        eng = pod["spec"]["containers"][0]
        # the engine's socket is the sidecar's, through the same node directory
        url = json.loads(next(a for a in eng["args"] if "sidecar_url" in a).split("=", 1)[1])
        url = url.get("sidecar_url") or url["kv_connector_extra_config"]["sidecar_url"]
        assert url == f"unix://{config.socket}"
        assert volume(pod["spec"], eng, sock_dir)["hostPath"]["path"] == run["path"]
        assert gid in pod["spec"]["securityContext"]["supplementalGroups"]
        env = {e["name"]: e for e in eng["env"]}
        # roles never share a secret: an engine mounts no token (the socket knows its uid)
        assert "SIDECAR_TOKEN" not in env and "kv-sidecar-token" not in json.dumps(pod)
        assert env["PYTHONPATH"]["value"] in {m["mountPath"] for m in eng["volumeMounts"]}


root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="runs the sidecar as uid 10001: needs root"
)


@root_only
def test_init_container_dirs_start_the_sidecar_and_admit_only_its_group():
    """The node as the kubelet leaves it (hostPath DirectoryOrCreate: root, 0755), the init
    script run on it, then the sidecar's own args as uid 10001: it starts, the readiness
    probe's command passes, an engine uid in group 10001 sets a page over the socket and
    one outside the group cannot connect."""
    from loadtest.kit.as_uid import Sidecar, as_user

    spec = daemonset()["spec"]["template"]["spec"]
    init, side = spec["initContainers"][0], spec["containers"][0]
    uid, gid = spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]
    base = tempfile.mkdtemp(dir="/tmp")
    os.chmod(base, 0o755)
    try:
        node = {m["mountPath"]: os.path.join(base, m["name"]) for m in init["volumeMounts"]}
        for d in node.values():
            os.mkdir(d, 0o755)
        cmd = [node.get(a, a) for a in init["command"]]
        subprocess.run(cmd, check=True, timeout=30)
        with Sidecar(side["args"], node, uid, gid, token="t0ken") as srv:
            probe = side["readinessProbe"]["exec"]["command"]
            code = probe[-1].replace("127.0.0.1:8411", f"127.0.0.1:{srv.port}")
            env = {**os.environ, "SIDECAR_TOKEN": "t0ken"}
            assert subprocess.run([sys.executable, "-c", code], env=env, timeout=30).returncode == 0
            env["SIDECAR_TOKEN"] = "wrong"
            assert (
                subprocess.run(
                    [sys.executable, "-c", code], env=env, timeout=30, capture_output=True
                ).returncode
                != 0
            )
            # an engine in the group stores and reads a page with no token at all
            assert as_user(srv.engine_put, None, uid=20001, groups=[gid]) == b"p" * 4096
            assert as_user(srv.engine_connect, uid=20002) == "PermissionError"
        assert srv.returncode == 0, srv.log()
    finally:
        shutil.rmtree(base, ignore_errors=True)
