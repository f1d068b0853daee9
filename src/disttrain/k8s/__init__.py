"""Kubernetes (K3s + HAMi vGPU) support: render a JobSpec to objects, run them on a cluster
or on emulated hosts.

    render.py    spec -> objects, pure (no `kubernetes` import), with code.py (ConfigMap),
                 hami.py (vGPU resources), security.py (PSS), output.py (YAML/JSON)
    labels.py    the label / annotation keys render writes and client reads back
    client.py    apply / status / logs / delete (the only importer of `kubernetes`)
    local.py     run-local: the rendered pods in network namespaces
    logtee.py    print pods' log lines, keep each pod's tail (client and local)

Kept import-light on purpose: `disttrain k8s render` must work where the `kubernetes`
client is not installed or no cluster is reachable.
"""
