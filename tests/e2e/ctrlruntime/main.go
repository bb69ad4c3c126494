// opgate-ctrlruntime is a small but real controller-runtime manager for tests/e2e/test_ctrlruntime.py:
// each Widget (demo.opgate.dev/v1, examples/reconciler/widget-crd.yaml) gets a ConfigMap of the
// same name, written with server-side apply and controlled by the Widget; the Widget's status
// gets observedGeneration and a Ready condition through the status subresource; an event
// (events.k8s.io/v1) tells each outcome. The manager runs as most operators do: leader election
// on a Lease, the cached client (shared informers, watch-list when client-go enables it), a
// metadata-only watch of the owned ConfigMaps, its metrics and health listeners off.
//
// It prints JSON lines on stdout:
//
//	{"kind":"http", ...}        every request the client made (method, path, query, code, retryAfter)
//	{"kind":"leader"}           the manager became the leader
//	{"kind":"reconciled", ...}  a Widget's ConfigMap applied and its status written
//	{"kind":"error", ...}       a reconcile failed (apierrors.Is* verdicts, code, message)
//
// and controller-runtime's own log on stderr. It runs until SIGTERM/SIGINT (exit 0) or until the
// manager stops on its own, e.g. when it lost the lease (exit 1).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
)

const fieldOwner = "widget-controller"

var widgetGVK = schema.GroupVersionKind{Group: "demo.opgate.dev", Version: "v1", Kind: "Widget"}

var outMu sync.Mutex

func emit(kind string, fields map[string]any) {
	fields["kind"] = kind
	line, err := json.Marshal(fields)
	if err != nil {
		panic(err)
	}
	outMu.Lock()
	defer outMu.Unlock()
	os.Stdout.Write(append(line, '\n'))
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "opgate-ctrlruntime: "+format+"\n", args...)
	os.Exit(2)
}

// logged records every request and its answer's head; a watch is recorded when its head arrives.
type logged struct{ next http.RoundTripper }

func (l logged) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := l.next.RoundTrip(req)
	fields := map[string]any{"method": req.Method, "path": req.URL.Path, "query": req.URL.RawQuery,
		"ctype": req.Header.Get("Content-Type")}
	if err != nil {
		fields["err"] = err.Error()
	} else {
		fields["code"] = resp.StatusCode
		fields["retryAfter"] = resp.Header.Get("Retry-After")
	}
	emit("http", fields)
	return resp, err
}

func emitError(name, op string, err error) {
	fields := map[string]any{"name": name, "op": op, "message": err.Error(),
		"forbidden": apierrors.IsForbidden(err), "tooManyRequests": apierrors.IsTooManyRequests(err),
		"code": 0, "reason": string(apierrors.ReasonForError(err))}
	if status, ok := err.(apierrors.APIStatus); ok {
		fields["code"] = status.Status().Code
	}
	emit("error", fields)
}

type reconciler struct {
	client.Client
	recorder events.EventRecorder
}

func newWidget() *unstructured.Unstructured {
	w := &unstructured.Unstructured{}
	w.SetGroupVersionKind(widgetGVK)
	return w
}

func (r *reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	w := newWidget()
	if err := r.Get(ctx, req.NamespacedName, w); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if err := r.applyConfigMap(ctx, w); err != nil {
		emitError(req.Name, "apply", err)
		r.recorder.Eventf(w, nil, corev1.EventTypeWarning, "ApplyFailed", "ApplyConfigMap", "%v", err)
		return ctrl.Result{}, err
	}
	if err := r.writeStatus(ctx, w); err != nil {
		emitError(req.Name, "status", err)
		return ctrl.Result{}, err
	}
	r.recorder.Eventf(w, nil, corev1.EventTypeNormal, "Reconciled", "ApplyConfigMap",
		"ConfigMap %s applied", req.Name)
	emit("reconciled", map[string]any{"name": req.Name, "namespace": req.Namespace,
		"generation": w.GetGeneration()})
	return ctrl.Result{}, nil
}

// applyConfigMap writes the Widget's ConfigMap with server-side apply (the fields this manager
// owns: data and the controller reference), as controller-runtime's Client.Apply does it.
func (r *reconciler) applyConfigMap(ctx context.Context, w *unstructured.Unstructured) error {
	data, _, err := unstructured.NestedStringMap(w.Object, "spec", "data")
	if err != nil {
		return err
	}
	owner := metav1ac.OwnerReference().WithAPIVersion(widgetGVK.GroupVersion().String()).
		WithKind(widgetGVK.Kind).WithName(w.GetName()).WithUID(w.GetUID()).
		WithController(true).WithBlockOwnerDeletion(true)
	cm := corev1ac.ConfigMap(w.GetName(), w.GetNamespace()).WithData(data).
		WithOwnerReferences(owner)
	return r.Apply(ctx, cm, client.FieldOwner(fieldOwner), client.ForceOwnership)
}

func (r *reconciler) writeStatus(ctx context.Context, w *unstructured.Unstructured) error {
	// the conditions as they are, so that SetStatusCondition keeps an unchanged one's
	// lastTransitionTime and a second pass writes nothing new (no update event, no new pass)
	var current struct {
		Items []metav1.Condition `json:"items"`
	}
	if raw, found, _ := unstructured.NestedSlice(w.Object, "status", "conditions"); found {
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(
			map[string]any{"items": raw}, &current); err != nil {
			return err
		}
	}
	conditions := current.Items
	meta.SetStatusCondition(&conditions, metav1.Condition{Type: "Ready", Status: metav1.ConditionTrue,
		Reason: "Reconciled", Message: "ConfigMap applied", ObservedGeneration: w.GetGeneration()})
	items := make([]any, 0, len(conditions))
	for _, c := range conditions {
		u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&c)
		if err != nil {
			return err
		}
		items = append(items, u)
	}
	status := map[string]any{"observedGeneration": w.GetGeneration(), "conditions": items}
	if err := unstructured.SetNestedField(w.Object, status, "status"); err != nil {
		return err
	}
	return r.Status().Update(ctx, w)
}

type options struct {
	kubeconfig     string
	namespace      string
	leaseNamespace string
	leaseName      string
	leaseDuration  time.Duration
	renewDeadline  time.Duration
	retryPeriod    time.Duration
	workers        int
}

func parse() options {
	var o options
	// a FlagSet of its own: controller-runtime registers --kubeconfig on the global one
	fs := flag.NewFlagSet("opgate-ctrlruntime", flag.ExitOnError)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (its server is opgate)")
	fs.StringVar(&o.namespace, "namespace", "", "the namespace whose Widgets are reconciled")
	fs.StringVar(&o.leaseNamespace, "lease-namespace", "", "namespace of the leader Lease")
	fs.StringVar(&o.leaseName, "lease-name", "widget-controller", "name of the leader Lease")
	fs.DurationVar(&o.leaseDuration, "lease-duration", 15*time.Second, "LeaseDuration")
	fs.DurationVar(&o.renewDeadline, "renew-deadline", 10*time.Second, "RenewDeadline")
	fs.DurationVar(&o.retryPeriod, "retry-period", 2*time.Second, "RetryPeriod")
	fs.IntVar(&o.workers, "workers", 1, "MaxConcurrentReconciles")
	if err := fs.Parse(os.Args[1:]); err != nil {
		fail("%v", err)
	}
	if o.kubeconfig == "" || o.namespace == "" {
		fail("--kubeconfig and --namespace are required")
	}
	if o.leaseNamespace == "" {
		o.leaseNamespace = o.namespace
	}
	return o
}

func main() {
	o := parse()
	ctrl.SetLogger(zap.New(zap.UseDevMode(false), zap.WriteTo(os.Stderr)))
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		fail("kubeconfig: %v", err)
	}
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return logged{rt} }
	if err := run(cfg, o); err != nil {
		fmt.Fprintf(os.Stderr, "opgate-ctrlruntime: %v\n", err)
		os.Exit(1)
	}
}

func run(cfg *rest.Config, o options) error {
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                        scheme,
		Cache:                         cache.Options{DefaultNamespaces: map[string]cache.Config{o.namespace: {}}},
		Metrics:                       metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:        "0",
		LeaderElection:                true,
		LeaderElectionID:              o.leaseName,
		LeaderElectionNamespace:       o.leaseNamespace,
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 &o.leaseDuration,
		RenewDeadline:                 &o.renewDeadline,
		RetryPeriod:                   &o.retryPeriod,
	})
	if err != nil {
		return fmt.Errorf("manager: %w", err)
	}
	r := &reconciler{Client: mgr.GetClient(), recorder: mgr.GetEventRecorder(fieldOwner)}
	if err := ctrl.NewControllerManagedBy(mgr).Named("widget").For(newWidget()).
		Owns(&corev1.ConfigMap{}, builder.OnlyMetadata).
		WithOptions(controller.Options{MaxConcurrentReconciles: o.workers}).
		Complete(r); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	ctx := ctrl.SetupSignalHandler()
	go func() {
		select {
		case <-mgr.Elected():
			emit("leader", map[string]any{"lease": o.leaseNamespace + "/" + o.leaseName})
		case <-ctx.Done():
		}
	}()
	if err := mgr.Start(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
