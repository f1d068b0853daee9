"""Kubernetes (K3s + HAMi vGPU) support: render a JobSpec to objects, run them on a cluster
or on emulated hosts.

    render.py    spec -> objects, pure (no `kubernetes` import), with code.py (ConfigMap),
                 hami.py (vGPU resources), security.py (PSS), output.py (YAML/JSON)
    labels.py    the label / annotation keys render writes and client reads back
    client.py    apply / status / logs / delete: the verbs (`Cluster`), over
      api.py         the raw calls on dict objects (the only importer of `kubernetes`),
      objects.py     object names, render hashes, which objects are disttrain's,
      pod_status.py  what a pod's object says (rank, phase, GPUs, why Pending),
      kubeconfig.py  which kubeconfig (KUBECONFIG, ~/.kube/config, K3s's file)
    local.py     run-local: the rendered pods in network namespaces
    logtee.py    print pods' log lines, keep each pod's tail (client and local)
    workloads.py the multi-pod kinds: Indexed Job + Service, PyTorchJob, JobSet, TrainJob
    gang.py      all pods or none: the Kueue queue label, the Coscheduling PodGroup
    capacity.py  does the gang fit now: free HAMi slices per node
    pending.py   why a pod is not running; the verdict of an incomplete rendezvous
    install.py   `--install-disttrain` at pod start, keeping the image's torch
    script_files.py  the files a shipped script reads and writes beside itself
    output_place.py  is train.output_dir somewhere that outlives the pod
    stopping.py  how a rendered pod stops when the cluster stops it (exit 75, resumable)
    mesh_layout.py   the parallelism mesh on pods x processes (tp within a pod, pp across)
    local_pods.py    the pods a cluster would create, as run-local runs them, over
    netns.py     the emulated hosts (network namespaces on one bridge)

Kept import-light on purpose: `disttrain k8s render` must work where the `kubernetes`
client is not installed or no cluster is reachable.
"""
