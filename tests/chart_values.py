"""The Helm value sets the chart is checked with: tests/test_chart.py renders each, and
tests/operator/test_rbac_on_kube.py checks its RBAC variants cover the rules of every one."""

VALUE_SETS = {
    "default": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "gang": {"gangScheduling": {"enabled": True}, "failingNodes": {"taint": True}},
    "gang-volcano-namespaced": {
        "watchNamespaces": ["team-a"],
        "gangScheduling": {"enabled": True, "schedulers": ["volcano"]},
    },
    "peering": {"operator": {"peering": "kubetron"}},
    "dashboard": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}},
    "peering-namespaced": {"operator": {"peering": "kubetron"}, "watchNamespaces": ["team-a", "team-b"]},
    "replicas": {"replicas": 2},
    "replicas-namespaced": {"replicas": 3, "watchNamespaces": ["team-a"]},
    "custom": {
        "image": {"repository": "registry.example.com/ml/kubetron-operator", "tag": "dev",
                  "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "fullnameOverride": "kt",
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "operator": {"healthPort": 9090,
                     "extraEnv": [{"name": "TZ", "value": "UTC"}]},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "512Mi"}},
        "podAnnotations": {"prometheus.io/scrape": "false"},
        "podLabels": {"team": "ml"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    },
}
