// opgate-clientgo drives a real client-go (the version of the e2e kube-apiserver) through opgate
// for tests/e2e/test_clientgo.py. Each subcommand prints JSON lines on stdout:
//
//	{"kind":"http", ...}     every request the client made (method, path, query, code, content type)
//	{"kind":"warning", ...}  every Warning header, as client-go's WarningHandler got it
//	{"kind":"error", ...}    an API error as client-go decoded it (apierrors.Is*)
//
// plus the subcommand's own lines. It exits 0 when the calls were made, whatever they answered;
// 2 on a usage or setup error.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/apimachinery/pkg/watch"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/remotecommand"
)

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
	fmt.Fprintf(os.Stderr, "opgate-clientgo: "+format+"\n", args...)
	os.Exit(2)
}

// logged records every request and its answer's head; a watch is recorded when its head arrives.
type logged struct{ next http.RoundTripper }

func (l logged) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := l.next.RoundTrip(req)
	fields := map[string]any{"method": req.Method, "path": req.URL.Path, "query": req.URL.RawQuery,
		"ctype": req.Header.Get("Content-Type"), "accept": req.Header.Get("Accept")}
	if err != nil {
		fields["err"] = err.Error()
	} else {
		fields["code"] = resp.StatusCode
		fields["proto"] = resp.Proto
		fields["gunzipped"] = resp.Uncompressed // Go's transport asked for gzip and got it
		fields["rctype"] = resp.Header.Get("Content-Type")
		fields["retryAfter"] = resp.Header.Get("Retry-After")
	}
	emit("http", fields)
	return resp, err
}

type printWarnings struct{}

func (printWarnings) HandleWarningHeaderWithContext(_ context.Context, code int, agent, text string) {
	emit("warning", map[string]any{"code": code, "agent": agent, "text": text})
}

func emitError(op string, err error) {
	fields := map[string]any{"op": op, "message": err.Error(),
		"forbidden": apierrors.IsForbidden(err), "tooManyRequests": apierrors.IsTooManyRequests(err),
		"conflict": apierrors.IsConflict(err), "expired": apierrors.IsResourceExpired(err),
		"gone": apierrors.IsGone(err), "code": 0, "reason": string(apierrors.ReasonForError(err))}
	if status, ok := err.(apierrors.APIStatus); ok {
		fields["code"] = status.Status().Code
		if d := status.Status().Details; d != nil {
			fields["retryAfterSeconds"] = d.RetryAfterSeconds
			fields["details"] = map[string]any{"name": d.Name, "group": d.Group, "kind": d.Kind}
		}
	}
	emit("error", fields)
}

type options struct {
	kubeconfig string
	namespace  string
	protobuf   bool
	json       bool
	as         string
}

func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (the server is opgate)")
	fs.StringVar(&o.namespace, "namespace", "default", "namespace")
	fs.BoolVar(&o.protobuf, "protobuf", false, "talk protobuf, as controllers' typed clients do")
	fs.BoolVar(&o.json, "json", false, "talk JSON only")
	fs.StringVar(&o.as, "as", "", "impersonate this user (Impersonate-User)")
}

func (o *options) config() *rest.Config {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		fail("kubeconfig: %v", err)
	}
	if o.protobuf {
		cfg.ContentType = runtime.ContentTypeProtobuf
		cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	} else if o.json {
		cfg.ContentType, cfg.AcceptContentTypes = runtime.ContentTypeJSON, runtime.ContentTypeJSON
	}
	cfg.Impersonate.UserName = o.as
	cfg.QPS, cfg.Burst = 1000, 1000 // opgate's limits are under test, not client-go's own
	cfg.WarningHandlerWithContext = printWarnings{}
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return logged{rt} })
	return cfg
}

func (o *options) clientset() *kubernetes.Clientset {
	cs, err := kubernetes.NewForConfig(o.config())
	if err != nil {
		fail("clientset: %v", err)
	}
	return cs
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: opgate-clientgo informer|list|apply|get|create|version [flags]")
	}
	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	var o options
	o.register(fs)
	ctx := context.Background()
	switch cmd {
	case "informer":
		parse(fs, args)
		informer(ctx, o.clientset(), o.namespace)
	case "list":
		limit := fs.Int64("limit", 2, "page size")
		rv := fs.String("resource-version", "", "list at this resourceVersion")
		rvMatch := fs.String("resource-version-match", "", "Exact | NotOlderThan")
		parse(fs, args)
		list(ctx, o.clientset(), o.namespace, metav1.ListOptions{Limit: *limit,
			ResourceVersion: *rv, ResourceVersionMatch: metav1.ResourceVersionMatch(*rvMatch)})
	case "apply":
		name := fs.String("name", "", "ConfigMap name")
		manager := fs.String("manager", "opgate-e2e", "field manager")
		force := fs.Bool("force", false, "take over conflicting fields")
		data := fs.String("data", "", "k=v,k=v")
		parse(fs, args)
		apply(ctx, o.clientset(), o.namespace, *name, *manager, *force, *data)
	case "get":
		name := fs.String("name", "", "ConfigMap name")
		count := fs.Int("count", 1, "how many GETs, one after another")
		retries := fs.Int("max-retries", -1, "client-go's retries of a 429/5xx (-1: its default, 10)")
		parse(fs, args)
		get(ctx, o.config(), o.namespace, *name, *count, *retries)
	case "create":
		resource := fs.String("resource", "configmaps", "configmaps | secrets")
		name := fs.String("name", "", "object name (with --count: name-0, name-1, ...)")
		generate := fs.Bool("generate-name", false, "send the name as generateName")
		count := fs.Int("count", 1, "how many objects, one after another")
		owner := fs.String("owner", "", "Kind/name of a controlling ownerReference")
		parse(fs, args)
		for i := 0; i < *count; i++ {
			meta := metav1.ObjectMeta{Name: *name, Namespace: o.namespace}
			if *count > 1 {
				meta.Name = fmt.Sprintf("%s-%d", *name, i)
			}
			if *generate {
				meta.GenerateName, meta.Name = meta.Name, ""
			}
			if kind, ownerName, ok := strings.Cut(*owner, "/"); ok {
				meta.OwnerReferences = []metav1.OwnerReference{{APIVersion: "demo.opgate.dev/v1",
					Kind: kind, Name: ownerName, UID: "00000000-0000-0000-0000-000000000001",
					Controller: ptr(true)}}
			}
			create(ctx, o.clientset(), *resource, meta)
		}
	case "exec":
		pod := fs.String("pod", "", "pod name")
		parse(fs, args)
		execIn(ctx, o.config(), o.namespace, *pod)
	case "version":
		parse(fs, args)
		v, err := o.clientset().Discovery().ServerVersion()
		if err != nil {
			fail("version: %v", err)
		}
		emit("version", map[string]any{"gitVersion": v.GitVersion})
	default:
		fail("unknown subcommand %q", cmd)
	}
}

func parse(fs *flag.FlagSet, args []string) {
	if err := fs.Parse(args); err != nil || fs.NArg() != 0 {
		fail("bad arguments: %v", args)
	}
}

// shownWatch passes a watch's events on and prints each ERROR event as client-go decodes it
// (the reflector itself reports a 410 from a watch to no handler: it just lists again).
type shownWatch struct {
	watch.Interface
	out  chan watch.Event
	done chan struct{}
	once sync.Once
}

func showErrors(w watch.Interface) watch.Interface {
	s := &shownWatch{Interface: w, out: make(chan watch.Event), done: make(chan struct{})}
	go func() {
		defer close(s.out)
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				emitError("watch-event", apierrors.FromObject(ev.Object))
			}
			select {
			case s.out <- ev:
			case <-s.done:
				return
			}
		}
	}()
	return s
}

func (s *shownWatch) ResultChan() <-chan watch.Event { return s.out }

func (s *shownWatch) Stop() {
	s.once.Do(func() { close(s.done) })
	s.Interface.Stop()
}

// informer runs a shared informer on the namespace's ConfigMaps (the ListWatch the factory's
// would use, its watches' ERROR events printed) and prints what its handlers get until stdin
// closes; each line read from stdin prints the store's keys.
func informer(ctx context.Context, cs *kubernetes.Clientset, ns string) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	configMaps := cs.CoreV1().ConfigMaps(ns)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			return configMaps.List(ctx, opts)
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			w, err := configMaps.Watch(ctx, opts)
			if err != nil {
				return nil, err
			}
			return showErrors(w), nil
		},
	}
	inf := cache.NewSharedIndexInformer(lw, &corev1.ConfigMap{}, 0, cache.Indexers{})
	show := func(event string, obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		cm := obj.(*corev1.ConfigMap)
		emit("event", map[string]any{"type": event, "name": cm.Name, "rv": cm.ResourceVersion,
			"data": cm.Data})
	}
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { show("add", obj) },
		UpdateFunc: func(_, obj any) { show("update", obj) },
		DeleteFunc: func(obj any) { show("delete", obj) },
	})
	if err != nil {
		fail("handler: %v", err)
	}
	if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		emitError("watch", err)
	}); err != nil {
		fail("watch error handler: %v", err)
	}
	go inf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		fail("the informer never synced")
	}
	emit("synced", map[string]any{"rv": inf.LastSyncResourceVersion(),
		"items": len(inf.GetStore().ListKeys())})
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		keys := inf.GetStore().ListKeys()
		sort.Strings(keys)
		emit("store", map[string]any{"keys": keys, "rv": inf.LastSyncResourceVersion()})
	}
	cancel()
}

func list(ctx context.Context, cs *kubernetes.Clientset, ns string, opts metav1.ListOptions) {
	var names []string
	for {
		page, err := cs.CoreV1().ConfigMaps(ns).List(ctx, opts)
		if err != nil {
			emitError("list", err)
			return
		}
		for _, cm := range page.Items {
			names = append(names, cm.Name)
		}
		emit("page", map[string]any{"items": len(page.Items), "rv": page.ResourceVersion,
			"continue": page.Continue != "", "remaining": page.RemainingItemCount})
		if page.Continue == "" {
			break
		}
		opts.Continue = page.Continue
	}
	emit("list", map[string]any{"names": names})
}

func apply(ctx context.Context, cs *kubernetes.Clientset, ns, name, manager string, force bool, data string) {
	want := map[string]string{}
	for _, kv := range strings.Split(data, ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			want[k] = v
		}
	}
	cm, err := cs.CoreV1().ConfigMaps(ns).Apply(ctx, corev1ac.ConfigMap(name, ns).WithData(want),
		metav1.ApplyOptions{FieldManager: manager, Force: force})
	if err != nil {
		emitError("apply", err)
		return
	}
	var managers []string
	for _, entry := range cm.ManagedFields {
		managers = append(managers, entry.Manager+"/"+string(entry.Operation))
	}
	sort.Strings(managers)
	emit("applied", map[string]any{"name": cm.Name, "rv": cm.ResourceVersion, "data": cm.Data,
		"managers": managers})
}

// get uses the REST client as the typed clients do, so that the retries of a 429 are client-go's.
func get(ctx context.Context, cfg *rest.Config, ns, name string, count, retries int) {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fail("clientset: %v", err)
	}
	for i := 0; i < count; i++ {
		req := cs.CoreV1().RESTClient().Get().Namespace(ns).Resource("configmaps").Name(name)
		if retries >= 0 {
			req = req.MaxRetries(retries)
		}
		started := time.Now()
		var cm corev1.ConfigMap
		err := req.Do(ctx).Into(&cm)
		if err != nil {
			emitError("get", err)
			continue
		}
		emit("got", map[string]any{"name": cm.Name, "seconds": time.Since(started).Seconds()})
	}
}

func ptr[T any](v T) *T { return &v }

func create(ctx context.Context, cs *kubernetes.Clientset, resource string, meta metav1.ObjectMeta) {
	var err error
	var made metav1.Object
	ns := meta.Namespace
	switch resource {
	case "configmaps":
		made, err = cs.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: meta}, metav1.CreateOptions{})
	case "secrets":
		made, err = cs.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: meta}, metav1.CreateOptions{})
	default:
		fail("unknown resource %q", resource)
	}
	if err != nil {
		emitError("create", err)
		return
	}
	emit("created", map[string]any{"resource": resource, "name": made.GetName()})
}

// execIn runs `true` in a pod as kubectl does (WebSocket, falling back to SPDY) and prints the
// outcome: an upgrade the apiserver refuses must come back as its Status.
func execIn(ctx context.Context, cfg *rest.Config, ns, pod string) {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fail("clientset: %v", err)
	}
	req := cs.CoreV1().RESTClient().Post().Namespace(ns).Resource("pods").Name(pod).
		SubResource("exec").VersionedParams(&corev1.PodExecOptions{Command: []string{"true"},
		Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ws, err := remotecommand.NewWebSocketExecutor(cfg, "GET", req.URL().String())
	if err != nil {
		fail("websocket executor: %v", err)
	}
	spdy, err := remotecommand.NewSPDYExecutor(cfg, "POST", req.URL())
	if err != nil {
		fail("spdy executor: %v", err)
	}
	exec, err := remotecommand.NewFallbackExecutor(ws, spdy, httpstream.IsUpgradeFailure)
	if err != nil {
		fail("fallback executor: %v", err)
	}
	var out, errOut strings.Builder
	err = exec.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &out, Stderr: &errOut})
	if err != nil {
		emitError("exec", err)
		return
	}
	emit("exec", map[string]any{"stdout": out.String(), "stderr": errOut.String()})
}
