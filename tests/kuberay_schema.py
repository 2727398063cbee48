"""A JSON Schema of the KubeRay RayService (apiVersion ray.io/v1) fields that
deploy/kuberay/rayservice.yaml uses, written from the operator's CRD
(ray-operator/config/crd/bases/ray.io_rayservices.yaml, KubeRay 1.x): field names, types and
required fields as the CRD declares them.

The objects we describe list every property name the CRD gives them (so a misspelt field is an
error, as the API server's pruning would silently drop it); the properties we do not use are
left unconstrained. Pod templates are checked down to the containers' names, images, ports,
environment and resources. Nothing is fetched: the tests run offline.
"""
from __future__ import annotations

ANY = {}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
INT32 = {"type": "integer", "minimum": -(1 << 31), "maximum": (1 << 31) - 1}
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern":
            r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}]}


def _closed(properties: dict, required: list[str] = (), **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False,
            **extra}


CONTAINER = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "image": {"type": "string", "minLength": 1},
        "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "properties": {
            "containerPort": INT32, "name": {"type": "string"}, "protocol": {"type": "string"}}}},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "value": {"type": "string"}, "valueFrom": {"type": "object"}}}},
        "resources": {"type": "object", "properties": {
            "limits": {"type": "object", "additionalProperties": QUANTITY},
            "requests": {"type": "object", "additionalProperties": QUANTITY}}},
    },
}

POD_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {
    "metadata": {"type": "object"},
    "spec": {"type": "object", "required": ["containers"], "properties": {
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER}}}}}

HEAD_GROUP = _closed({
    "enableIngress": {"type": "boolean"}, "headService": ANY, "ingressOptions": ANY, "labels": STRING_MAP,
    "rayStartParams": STRING_MAP, "resources": STRING_MAP, "serviceType": {"type": "string"},
    "template": POD_TEMPLATE,
}, ["template"])

WORKER_GROUP = _closed({
    "groupName": {"type": "string"}, "idleTimeoutSeconds": INT32, "labels": STRING_MAP, "maxReplicas": INT32,
    "minReplicas": INT32, "numOfHosts": INT32, "priority": INT32, "rayStartParams": STRING_MAP, "replicas": INT32,
    "resources": STRING_MAP, "scaleStrategy": ANY, "suspend": {"type": "boolean"}, "template": POD_TEMPLATE,
}, ["groupName", "maxReplicas", "minReplicas", "template"])

RAY_CLUSTER_CONFIG = _closed({
    "authOptions": ANY, "autoscalerOptions": ANY, "enableInTreeAutoscaling": {"type": "boolean"},
    "gcsFaultToleranceOptions": ANY, "headGroupSpec": HEAD_GROUP, "headServiceAnnotations": STRING_MAP,
    "historyServerOptions": ANY, "managedBy": {"type": "string"}, "networkPolicy": ANY,
    "rayVersion": {"type": "string"}, "suspend": {"type": "boolean"}, "tlsOptions": ANY, "upgradeStrategy": ANY,
    "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
}, ["headGroupSpec"])

RAYSERVICE_SPEC = _closed({
    "deploymentUnhealthySecondThreshold": INT32, "excludeHeadPodFromServeSvc": {"type": "boolean"},
    "managedBy": {"type": "string"}, "rayClusterConfig": RAY_CLUSTER_CONFIG,
    "rayClusterDeletionDelaySeconds": {**INT32, "minimum": 0}, "serveConfigV2": {"type": "string"},
    "serveService": ANY, "serviceUnhealthySecondThreshold": INT32, "suspend": {"type": "boolean"},
    "upgradeStrategy": ANY,
}, ["rayClusterConfig"])

RAYSERVICE = _closed({
    "apiVersion": {"const": "ray.io/v1"},
    "kind": {"const": "RayService"},
    "metadata": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}}},
    "spec": RAYSERVICE_SPEC,
}, ["apiVersion", "kind", "metadata", "spec"])
