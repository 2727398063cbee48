"""The deployment files we ship (deploy/): the KubeRay manifest against a schema of the RayService
CRD's fields (tests/kuberay_schema.py, offline), the Ray Serve configs against sparseinfer's
application options and, where Ray is installed, against Ray Serve's own config schema; and the
Ray integration stays out of the import path of everything else."""
from __future__ import annotations

import copy
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from kuberay_schema import RAYSERVICE  # noqa: E402

from sparseinfer.errors import SparseInferError  # noqa: E402
from sparseinfer.server.ray_app import DEPLOYMENT_NAME, ReplicaOptions  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MANIFEST = DEPLOY / "kuberay" / "rayservice.yaml"
SERVE_CONFIG = DEPLOY / "ray" / "sparseinfer.yaml"


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def serve_configs() -> dict[str, dict]:
    """Each Ray Serve config we ship: the file, and the manifest's serveConfigV2."""
    return {"deploy/ray/sparseinfer.yaml": yaml.safe_load(SERVE_CONFIG.read_text()),
            "serveConfigV2": yaml.safe_load(manifest()["spec"]["serveConfigV2"])}


def test_manifest_matches_the_rayservice_schema():
    jsonschema.validate(manifest(), RAYSERVICE)


@pytest.mark.parametrize("damage", ["misspelt field", "wrong type", "missing required", "bad quantity"])
def test_the_schema_catches_damage(damage):
    m = copy.deepcopy(manifest())
    rcc = m["spec"]["rayClusterConfig"]
    if damage == "misspelt field":
        rcc["workerGroupSpec"] = rcc.pop("workerGroupSpecs")
    elif damage == "wrong type":
        rcc["workerGroupSpecs"][0]["maxReplicas"] = "8"
    elif damage == "missing required":
        del rcc["workerGroupSpecs"][0]["minReplicas"]
    else:
        rcc["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "12 GB"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(m, RAYSERVICE)


@pytest.mark.parametrize("name", ["deploy/ray/sparseinfer.yaml", "serveConfigV2"])
def test_serve_config_fits_the_application(name):
    """The import path exists without importing Ray, the args are valid replica options, and the
    deployment's CPUs and request bounds follow its threads, slots and queue."""
    cfg = serve_configs()[name]
    [app] = cfg["applications"]
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    opts = ReplicaOptions.from_args(app["args"])
    [dep] = app["deployments"]
    assert dep["name"] == DEPLOYMENT_NAME
    assert dep["ray_actor_options"]["num_cpus"] == opts.threads
    assert dep["max_ongoing_requests"] == opts.parallel + opts.max_queue
    assert dep["autoscaling_config"]["target_ongoing_requests"] == opts.parallel
    assert dep["graceful_shutdown_timeout_s"] > 0


def test_kuberay_replicas_fit_their_worker_pods():
    """The worker pods hold a whole number of replicas, and Ray's version is the manifest's."""
    m = manifest()
    [dep] = yaml.safe_load(m["spec"]["serveConfigV2"])["applications"][0]["deployments"]
    [worker] = m["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    cpus = int(worker["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])
    assert cpus % dep["ray_actor_options"]["num_cpus"] == 0
    assert m["spec"]["rayClusterConfig"]["rayVersion"].count(".") == 2


@pytest.mark.parametrize("name", ["deploy/ray/sparseinfer.yaml", "serveConfigV2"])
def test_serve_config_matches_ray_schema(name):
    schema = pytest.importorskip("ray.serve.schema")
    schema.ServeDeploySchema.model_validate(serve_configs()[name]) if hasattr(
        schema.ServeDeploySchema, "model_validate") else schema.ServeDeploySchema.parse_obj(serve_configs()[name])


def test_replica_options_refuse_unknown_names():
    with pytest.raises(SparseInferError, match="unknown sparseinfer application args"):
        ReplicaOptions.from_args({"modle": "smollm2"})
    with pytest.raises(SparseInferError, match="unknown limits"):
        ReplicaOptions.from_args({"limits": {"max_body": 1}})
    with pytest.raises(SparseInferError, match="threads must be an integer >= 1"):
        ReplicaOptions.from_args({"threads": 0})
    assert set(ReplicaOptions.from_args({}).to_args()) == {f.name for f in dataclasses.fields(ReplicaOptions)}


def test_ray_is_imported_only_for_ray():
    """`import sparseinfer`, the CLI and the server (the Ray module included) never import Ray."""
    code = ("import sys, sparseinfer, sparseinfer.commands, sparseinfer.server.app, sparseinfer.server.ray_app\n"
            "from sparseinfer.commands import build_parser\n"
            "build_parser().parse_args(['serve', '--ray', '--replicas', '2'])\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
