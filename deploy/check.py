#!/usr/bin/env python3
"""Offline checks of deploy/: the Dockerfile and the Helm chart, without a cluster.

    python3 deploy/check.py --ferry target/debug/ferry

Needs, importable or on PATH: helm-python-sdk (Helm's SDK: lint, values.schema.json,
render), kubernetes-validate (Kubernetes' OpenAPI schemas, offline) and hadolint;
.ci/run installs pinned versions into a virtual environment and runs this.

For the Dockerfile: hadolint, and the properties the chart relies on (multi-stage, a
non-root USER, exec-form ENTRYPOINT and CMD, UCX in the runtime stage).

For the chart, with every values file under deploy/helm/ferry/ci/: a strict lint; the
rendered manifests validated with `kubernetes-validate --strict` at the oldest and newest
Kubernetes the chart supports; then what schemas cannot see: the rendered ferry config
passes `ferry config check` (alone, and layered with the container's environment as the
pod would resolve it), the container's command line is one the binary accepts, probes and
ports match the config, the peer key's file passes ferry's ownership and mode checks, DNS
discovery looks up the headless Service's name on the port the pods listen on, and the GPU
operator's conventions are present. Last, values the chart must refuse.

Prints one line per check and ends with "N passed, M failed"; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "ferry"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# The Kubernetes releases checked: the chart's kubeVersion floor and the newest that
# kubernetes-validate knows.
KUBE_VERSIONS = ["1.25", "1.37"]
# What the checks substitute for the downward API, as a pod would see it.
FAKE_POD = {
    "status.podIP": "198.18.0.2",
    "spec.nodeName": "gpu-node-1",
    "metadata.name": "ferry-5d8f7-x2k9q",
}


class Report:
    """Collects named checks; each is a pass or a failure with its reason."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, name: str, ok: bool, why: str = "") -> bool:
        if ok:
            self.passed += 1
            print(f"ok    {name}")
        else:
            self.failed += 1
            print(f"FAIL  {name}" + (f": {why}" if why else ""))
        return ok

    def run(self, name: str, body: Callable[[], str | None]) -> None:
        """Runs `body`; a returned string or a raised exception is a failure."""
        try:
            problem = body()
        except Exception as e:  # a check that crashes is a failed check, not a crash
            problem = f"{type(e).__name__}: {e}"
        self.check(name, problem is None, problem or "")


# ---------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def check_dockerfile(report: Report, hadolint: str) -> list[str]:
    """Lints the Dockerfile; returns the runtime stage's ENTRYPOINT as a list."""
    result = subprocess.run(
        [hadolint, "--failure-threshold", "style", "--no-color", str(DOCKERFILE)],
        capture_output=True, text=True,
    )
    report.check("Dockerfile: hadolint, no finding at any level", result.returncode == 0,
                 (result.stdout + result.stderr).strip())

    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    stages = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    report.check("Dockerfile: multi-stage (a build stage and a runtime stage)", len(stages) >= 2,
                 f"{len(stages)} FROM")
    runtime = instructions[stages[-1]:] if stages else []
    build_names = [args.split()[-1] for word, args in instructions
                   if word == "FROM" and " AS " in args.upper()]
    report.check("Dockerfile: the runtime stage copies the binary from the build stage",
                 any(word == "COPY" and "--from=" in args and args.split("--from=")[1].split()[0]
                     in build_names for word, args in runtime))
    users = [args for word, args in runtime if word == "USER"]
    report.check("Dockerfile: the runtime stage's last USER is not root",
                 bool(users) and users[-1].split(":")[0] not in ("0", "root"),
                 f"USER {users[-1] if users else '(none)'}")
    entrypoint: list[str] = []
    for word in ("ENTRYPOINT", "CMD"):
        args = [a for w, a in runtime if w == word]
        try:
            parsed = json.loads(args[-1]) if args else None
        except json.JSONDecodeError:
            parsed = None
        report.check(f"Dockerfile: {word} in exec form (no shell at run time)",
                     isinstance(parsed, list) and all(isinstance(p, str) for p in parsed),
                     args[-1] if args else "missing")
        if word == "ENTRYPOINT" and isinstance(parsed, list):
            entrypoint = parsed
    report.check("Dockerfile: the runtime stage installs UCX (libucx0)",
                 any(word == "RUN" and "libucx0" in args for word, args in runtime))
    report.check("Dockerfile: no HEALTHCHECK (Kubernetes probes the pod instead)",
                 all(word != "HEALTHCHECK" for word, _ in instructions))
    return entrypoint


# ---------------------------------------------------------------------------------------
# Rendering


def render(helm: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart rendered with `values` as an install named "ferry" in namespace "gpu"."""
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values=values, name="ferry", namespace="gpu", is_install=True)
    docs = []
    for name, text in sorted(manifests.items()):
        if name.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def merged_values(helm: Any, values: dict[str, Any]) -> dict[str, Any]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.merge_values(values)


def find(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(docs, kind)
    if len(found) != 1:
        raise AssertionError(f"{len(found)} {kind} rendered, want 1")
    return found[0]


def workload(docs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    return one(docs, "DaemonSet" if mode == "daemonset" else "Deployment")


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for c in pod["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def resolve_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet resolves it for FAKE_POD: field
    references, then $(VAR) references to variables defined earlier in the list."""
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "valueFrom" in var:
            ref = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
            if ref not in FAKE_POD:
                raise AssertionError(f"env {var['name']}: cannot resolve {var['valueFrom']}")
            env[var["name"]] = FAKE_POD[ref]
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)",
                                      lambda m: env.get(m.group(1), m.group(0)),
                                      str(var.get("value", "")))
    return env


# ---------------------------------------------------------------------------------------
# Sizes: ferry's ("4 GiB", "1.5 GB", 4096) and Kubernetes' quantities ("8Gi", "500M")


def ferry_size(value: Any) -> int | None:
    """Bytes of a ferry size, or None for a percentage."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text.endswith("%"):
        return None
    m = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]*)", text)
    if not m:
        raise ValueError(f"not a size: {value!r}")
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    if m.group(2).lower() not in units:
        raise ValueError(f"not a size: {value!r}")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def kube_quantity(value: Any) -> int:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    if m.group(2) not in units:
        raise ValueError(f"not a quantity: {value!r}")
    return int(float(m.group(1)) * units[m.group(2)])


# ---------------------------------------------------------------------------------------
# What schemas cannot check


def check_rendering(report: Report, label: str, docs: list[dict[str, Any]],
                    values: dict[str, Any], ferry: str, entrypoint: list[str],
                    work: Path) -> None:
    mode = values["mode"]
    sts = workload(docs, mode)
    pod = sts["spec"]["template"]["spec"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    ferry_c = container(pod, "ferry")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["name"]: m for m in ferry_c.get("volumeMounts", [])}
    configmap = one(docs, "ConfigMap")
    config_text = configmap["data"]["ferry.yaml"]
    config = yaml.safe_load(config_text)
    env = resolve_env(ferry_c)
    name = lambda what: f"{label}: {what}"  # noqa: E731

    # The peer key, as the pod will read it.
    secret_file = config["security"]["secret_file"]
    secrets = find(docs, "Secret")
    key_bytes = os.urandom(32).hex().encode()
    if secrets:
        data = secrets[0]["data"][values["secret"]["key"]]
        key_bytes = base64.b64decode(data)
    local_key = work / f"{label}-peer-key"
    local_key.write_bytes(key_bytes)
    local_key.chmod(0o600)
    local_config = work / f"{label}-ferry.yaml"
    local = json.loads(json.dumps(config))
    local["security"]["secret_file"] = str(local_key)
    local_config.write_text(yaml.safe_dump(local))

    def config_check_alone() -> str | None:
        r = subprocess.run([ferry, "config", "check", str(local_config)],
                           capture_output=True, text=True)
        return None if r.returncode == 0 else (r.stdout + r.stderr).strip()
    report.run(name("the ConfigMap's ferry.yaml passes `ferry config check` "
                    "(secret_file pointed at a copy of the rendered key)"), config_check_alone)

    def config_check_layered() -> str | None:
        home = work / f"{label}-home"
        home.mkdir(exist_ok=True)
        pod_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                   "XDG_CONFIG_HOME": str(home)}
        pod_env.update(env)
        r = subprocess.run([ferry, "--config", str(local_config), "config", "check"],
                           capture_output=True, text=True, env=pod_env)
        if r.returncode != 0:
            return (r.stdout + r.stderr).strip()
        show = subprocess.run([ferry, "--config", str(local_config), "config", "show"],
                              capture_output=True, text=True, env=pod_env)
        want_listen = f'"{FAKE_POD["status.podIP"]}:{values["ports"]["ferry"]}"'
        if want_listen not in show.stdout:
            return f"node.listen is not {want_listen} in:\n{show.stdout}"
        return None
    report.run(name("the config layered with the container's environment passes "
                    "(node.name and node.listen from the pod)"), config_check_layered)

    def command_line() -> str | None:
        command = ferry_c.get("command") or entrypoint
        args = ferry_c.get("args", [])
        if command != entrypoint:
            return f"command {command} is not the image's ENTRYPOINT {entrypoint}"
        if args[:1] != ["serve"]:
            return f"args {args} do not run `serve`"
        if "--config" not in args or args[args.index("--config") + 1] != mounts["config"]["mountPath"]:
            return f"--config in {args} is not the ConfigMap's mount {mounts['config']['mountPath']}"
        # The binary parses every argument before --help acts: an unknown flag fails.
        r = subprocess.run([ferry, *args, "--help"], capture_output=True, text=True)
        return None if r.returncode == 0 else f"ferry {' '.join(args)}: {r.stderr.strip()}"
    report.run(name("the container's command line is one `ferry` accepts"), command_line)

    def files_match() -> str | None:
        cm_mount = mounts["config"]
        if volumes["config"]["configMap"]["name"] != configmap["metadata"]["name"] \
                or cm_mount.get("subPath") != "ferry.yaml":
            return "the config volume is not the ConfigMap's ferry.yaml"
        key_volume = volumes["peer-key"]["secret"]
        item = key_volume["items"][0]
        if item["key"] != values["secret"]["key"]:
            return f"the key volume takes {item['key']}, not secret.key"
        if f"{mounts['peer-key']['mountPath']}/{item['path']}" != secret_file:
            return f"security.secret_file {secret_file} is not where the key is mounted"
        if config["node"]["socket_dir"] != mounts["sockets"]["mountPath"]:
            return "node.socket_dir is not the socket volume's mount"
        return None
    report.run(name("config, key and socket paths match the mounts"), files_match)

    def key_file_mode() -> str | None:
        mode = volumes["peer-key"]["secret"]["defaultMode"]
        if mode & 0o077:
            return f"defaultMode {mode:o} gives group or others access; ferry refuses it"
        pod_sc = pod.get("securityContext", {})
        if "fsGroup" in pod_sc:
            return "fsGroup adds group read to the key file"
        uid = ferry_c.get("securityContext", {}).get("runAsUser", pod_sc.get("runAsUser"))
        # The kubelet writes Secret files owned by root: only root can read a 0400 one
        # and pass ferry's owner check (owner = this user or root).
        if uid != 0:
            return f"runAsUser {uid}: a root-owned 0{mode:o} key file is unreadable to it"
        return None
    report.run(name("the peer key file passes ferry's owner and mode checks"), key_file_mode)

    def probes_and_ports() -> str | None:
        metrics_port = int(config["telemetry"]["metrics_listen"].rsplit(":", 1)[1])
        ports = {p["name"]: p["containerPort"] for p in ferry_c["ports"]}
        if ports.get("metrics") != metrics_port:
            return f"port metrics {ports.get('metrics')} != metrics_listen port {metrics_port}"
        if ports.get("ferry") != values["ports"]["ferry"]:
            return "port ferry is not ports.ferry"
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = ferry_c[probe]["httpGet"]
            port = ports.get(get["port"], get["port"])
            if port != metrics_port or get["path"] != path:
                return f"{probe} GET {get['path']} on {port}, want {path} on {metrics_port}"
        return None
    report.run(name("probes GET /healthz and /readyz on telemetry.metrics_listen's port"),
               probes_and_ports)

    def gpu_operator() -> str | None:
        runtime_class = values["gpu"]["runtimeClassName"]
        if runtime_class and pod.get("runtimeClassName") != runtime_class:
            return f"runtimeClassName {pod.get('runtimeClassName')}, want {runtime_class}"
        if pod.get("nodeSelector", {}).get("nvidia.com/gpu.present") != "true":
            return "no nodeSelector nvidia.com/gpu.present=true"
        if not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])):
            return "no toleration for the nvidia.com/gpu taint"
        ferry_limits = ferry_c.get("resources", {}).get("limits", {})
        if mode == "daemonset":
            for var in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
                if not env.get(var):
                    return f"the DaemonSet's ferry sets no {var}"
            if "nvidia.com/gpu" in ferry_limits:
                return "the DaemonSet takes nvidia.com/gpu from the scheduler"
        else:
            apps = [c for c in pod["containers"] if c["name"] != "ferry"]
            if not any(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) >= 1
                       for c in apps):
                return "no container of the sidecar pod requests nvidia.com/gpu"
        return None
    report.run(name("GPU operator conventions (runtime class, node label, taint, GPU env or "
                    "request)"), gpu_operator)

    def pod_security() -> str | None:
        sc = ferry_c.get("securityContext", {})
        caps = sc.get("capabilities", {})
        if caps.get("add") != ["IPC_LOCK"] or "ALL" not in caps.get("drop", []):
            return f"capabilities {caps}, want drop ALL, add IPC_LOCK only"
        if sc.get("readOnlyRootFilesystem") is not True or sc.get("allowPrivilegeEscalation") is not False:
            return "want readOnlyRootFilesystem true and allowPrivilegeEscalation false"
        if sc.get("privileged"):
            return "privileged"
        if pod.get("automountServiceAccountToken") is not False:
            return "a service account token is mounted"
        if bool(pod.get("hostIPC", False)) != bool(values["hostIPC"]):
            return f"hostIPC {pod.get('hostIPC')} but values say {values['hostIPC']}"
        return None
    report.run(name("restrictive securityContext (IPC_LOCK only, read-only root, no token)"),
               pod_security)

    def shared_memory() -> str | None:
        shm = volumes["shm"].get("emptyDir", {})
        if shm.get("medium") != "Memory" or mounts["shm"]["mountPath"] != "/dev/shm":
            return "/dev/shm is not a memory-backed emptyDir"
        if mode == "sidecar":
            for c in pod["containers"]:
                cm = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
                if cm.get("shm") != "/dev/shm" or cm.get("sockets") != mounts["sockets"]["mountPath"]:
                    return f"container {c['name']} does not share /dev/shm and the socket directory"
        return None
    report.run(name("/dev/shm memory-backed" + (", shared with the application" if mode == "sidecar" else "")),
               shared_memory)

    def memory_budget() -> str | None:
        limit = ferry_c.get("resources", {}).get("limits", {}).get("memory")
        if limit is None:
            return None
        mem = config.get("memory", {})
        host, pinned = ferry_size(mem.get("host", "50%")), ferry_size(mem.get("pinned", "25%"))
        if host is None or pinned is None:
            return "memory.host and memory.pinned are percentages of the host, not of the limit: give sizes"
        shm = kube_quantity(volumes["shm"]["emptyDir"].get("sizeLimit", 0))
        if host + pinned + shm > kube_quantity(limit):
            return f"memory.host + memory.pinned + /dev/shm = {host + pinned + shm} B > limit {limit}"
        return None
    report.run(name("memory budgets fit in the container's memory limit"), memory_budget)

    def networking() -> str | None:
        if values["rdma"]["enabled"]:
            res = ferry_c.get("resources", {})
            for rname, count in values["rdma"]["resources"].items():
                if res.get("requests", {}).get(rname) != count or res.get("limits", {}).get(rname) != count:
                    return f"{rname} is not requested and limited at {count}"
        if values["hostNetwork"]:
            if pod.get("hostNetwork") is not True or pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
                return "hostNetwork without dnsPolicy ClusterFirstWithHostNet"
        elif pod.get("hostNetwork"):
            return "hostNetwork though values say no"
        return None
    report.run(name("RDMA resources and host networking as the values say"), networking)

    def selectors() -> str | None:
        def covers(selector: dict[str, str], labels: dict[str, str]) -> bool:
            return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
        service = one(docs, "Service")
        if service["spec"].get("clusterIP") != "None":
            return "the Service is not headless"
        if not covers(service["spec"]["selector"], pod_labels):
            return "the Service does not select the pods"
        port_names = {p["name"] for p in ferry_c["ports"]}
        if any(p["targetPort"] not in port_names for p in service["spec"]["ports"]):
            return "a Service port targets no container port"
        pdb = one(docs, "PodDisruptionBudget")["spec"]
        if not covers(pdb["selector"]["matchLabels"], pod_labels):
            return "the PodDisruptionBudget does not select the pods"
        if mode == "daemonset" and ("maxUnavailable" in pdb or not isinstance(pdb.get("minAvailable"), int)):
            return "DaemonSet pods take only an integer minAvailable"
        for sm in find(docs, "ServiceMonitor"):
            if not covers(sm["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]):
                return "the ServiceMonitor does not select the Service"
            service_ports = {p["name"] for p in service["spec"]["ports"]}
            if any(e["port"] not in service_ports for e in sm["spec"]["endpoints"]):
                return "a ServiceMonitor endpoint names no Service port"
        return None
    report.run(name("Service (headless), PodDisruptionBudget and ServiceMonitor select the pods"),
               selectors)

    def dns_discovery() -> str | None:
        found = config.get("discovery", {})
        if not values["discovery"]["enabled"]:
            if found.get("mode") == "dns":
                return f"discovery.enabled is false but the config says {found}"
            return None
        service = one(docs, "Service")
        fqdn = f"{service['metadata']['name']}.gpu.svc.{values['discovery']['clusterDomain']}."
        want = [{"name": fqdn, "port": values["ports"]["ferry"]}]
        if found.get("mode") != "dns" or found.get("dns") != want:
            return f"config.discovery is {found}, want mode dns looking up {want}"
        if found.get("interval") != values["discovery"]["interval"]:
            return f"discovery.interval {found.get('interval')} is not the values' one"
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        ferry_port = service_ports.get("ferry", {})
        if ferry_port.get("port") != values["ports"]["ferry"] or ferry_port.get("targetPort") != "ferry":
            return f"the Service's ferry port {ferry_port} is not ports.ferry on the container's port"
        if service["spec"].get("publishNotReadyAddresses"):
            return "the Service lists pods before /readyz says ready: peers would dial them early"
        # Every pod says its own name: the pod's, or its Kubernetes node's in a DaemonSet.
        name_ref = next((v["valueFrom"]["fieldRef"]["fieldPath"] for v in ferry_c.get("env", [])
                         if v["name"] == "FERRY__NODE__NAME" and "valueFrom" in v), None)
        want_ref = "spec.nodeName" if mode == "daemonset" else "metadata.name"
        if name_ref != want_ref:
            return f"FERRY__NODE__NAME comes from {name_ref}, want {want_ref} (unique per pod)"
        if values["hostNetwork"] and pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
            return "host networking without dnsPolicy ClusterFirstWithHostNet cannot resolve the Service"
        return None
    report.run(name("DNS discovery looks up the headless Service on ports.ferry, "
                    "each pod named uniquely"), dns_discovery)


def kube_validate(report: Report, kv: list[str], files: list[Path]) -> None:
    for version in KUBE_VERSIONS:
        r = subprocess.run([*kv, "--strict", "--quiet", "-k", version, *map(str, files)],
                           capture_output=True, text=True)
        out = (r.stdout + r.stderr).strip()
        # A kind without a schema (ServiceMonitor, a CRD) is a warning, not a failure.
        errors = [line for line in out.splitlines() if not line.startswith("WARN")]
        report.check(f"kubernetes-validate --strict, Kubernetes {version}: "
                     f"{', '.join(f.stem for f in files)}",
                     r.returncode == 0 and not errors, out)


def check_refusals(report: Report, helm: Any) -> None:
    """Values the chart must refuse, each with the reason in its message."""
    bad = [
        ("podSecurityContext.fsGroup", {"podSecurityContext": {"runAsUser": 0, "fsGroup": 2000}}, "fsGroup"),
        ("config.node.listen", {"config": {"node": {"listen": ["0.0.0.0:7070"]}}}, "node.listen"),
        ("config.security", {"config": {"security": {"danger_insecure": True}}}, "security"),
        ("config.telemetry.metrics_listen", {"config": {"telemetry": {"metrics_listen": "127.0.0.1:1"}}}, "metrics_listen"),
        ("secret.defaultMode 0644", {"secret": {"key": "peer-key", "defaultMode": 0o644}}, "defaultMode"),
        ("sidecar without an application image", {"mode": "sidecar"}, "sidecar.app.image"),
        ("DNS discovery without the Service", {"service": {"enabled": False}}, "service.enabled"),
        ("config.discovery.dns with discovery.enabled",
         {"config": {"discovery": {"dns": [{"name": "x.example", "port": 1}]}}},
         "config.discovery.dns"),
    ]
    for what, values, expect in bad:
        try:
            render(helm, values)
            report.check(f"refused: {what}", False, "rendered without an error")
        except Exception as e:
            report.check(f"refused: {what}", expect in str(e), str(e))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ferry", required=True, help="the ferry binary to check configs with")
    parser.add_argument("--hadolint", default=shutil.which("hadolint") or "hadolint")
    parser.add_argument("--kubernetes-validate", dest="kv",
                        default=shutil.which("kubernetes-validate") or "kubernetes-validate")
    args = parser.parse_args()

    import helm_python as helm

    report = Report()
    entrypoint = check_dockerfile(report, args.hadolint)

    values_files = sorted((CHART / "ci").glob("*-values.yaml"))
    with tempfile.TemporaryDirectory(prefix="ferry-deploy-") as tmp:
        work = Path(tmp)
        rendered: list[Path] = []
        for path in values_files:
            label = path.name.removesuffix("-values.yaml")
            values = yaml.safe_load(path.read_text()) or {}
            lint = helm.lint(str(CHART), values, strict=True, kube_version="v1.25.0")
            problems = [m for m in lint["messages"] if m["severity"] >= 2] + lint["errors"]
            report.check(f"{label}: helm lint --strict", not problems, json.dumps(problems))
            try:
                docs = render(helm, values)
            except Exception as e:
                report.check(f"{label}: renders", False, str(e))
                continue
            out = work / f"{label}.yaml"
            out.write_text(yaml.safe_dump_all(docs))
            rendered.append(out)
            check_rendering(report, label, docs, merged_values(helm, values), args.ferry,
                            entrypoint, work)
        kube_validate(report, [args.kv], rendered)
        check_refusals(report, helm)

    print(f"\ndeploy checks: {report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
