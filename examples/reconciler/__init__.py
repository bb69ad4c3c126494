"""A minimal but honest Kubernetes operator that runs behind opgate.

Run it as ``python -m examples.reconciler --kubeconfig PATH [--namespace NS]``.

For every ``Widget`` (``demo.opgate.dev/v1``) it keeps a ConfigMap of the same name holding the
Widget's ``spec.data``, owned by the Widget; it puts the ``demo.opgate.dev/cleanup`` finalizer on
the Widget and deletes the ConfigMap before letting the Widget go; it reports ``Ready`` in
``status.conditions`` through the status subresource. It behaves like a client-go controller on
the wire (list then watch with bookmarks, relist on 410, Retry-After, backoff, conflict retries)
so that opgate's policies can be tried against realistic traffic.

Modules: ``config`` (kubeconfig), ``kube`` (the tiny aiohttp client), ``retry`` (Retry-After and
backoff), ``workqueue``, ``resources`` (pure desired state), ``reconciler`` (one Widget),
``controller`` (list/watch + workers), ``__main__`` (flags, logging, signals).
"""
