// Command opgate-fake-kubelet serves the kubelet's streaming endpoints (/exec, /attach,
// /portForward) with the kubelet's own server code (k8s.io/kubelet/pkg/cri/streaming), so that
// kube-apiserver's exec / attach / port-forward proxying can be driven end to end without a
// container runtime. "Containers" run a tiny built-in command set, never a shell:
//
//	echo ARGS...   ARGS joined by spaces, then a newline, on stdout
//	warn ARGS...   the same on stderr
//	cat            stdin copied to stdout until stdin ends
//	sha256         reads stdin to its end, prints "<bytes> <sha256 hex>"
//	yes N          N bytes of a fixed pattern on stdout, streamed in 64 KiB writes
//	exit N         exits with code N
//
// Attach runs "cat" (prints "attached" first). Port-forward connects every pod port to a TCP
// echo server of this process. It prints one JSON line on stdout once it listens:
// {"port": <TLS port>, "echo_port": <echo port>}; GET /stats (on the same TLS port) answers
// {"open": <streaming requests in progress>, "total": <streaming requests served>}.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/types"
	remotecommandconsts "k8s.io/apimachinery/pkg/util/remotecommand"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/kubelet/pkg/cri/streaming/portforward"
	streamremote "k8s.io/kubelet/pkg/cri/streaming/remotecommand"
	utilexec "k8s.io/utils/exec"
)

const (
	idleTimeout           = 5 * time.Minute // the kubelet's default streaming-connection-idle-timeout is 4h
	streamCreationTimeout = 30 * time.Second
	pattern               = "opgate-fake-kubelet 0123456789abcdefghijklmnopqrstuvwxyz\n"
)

var open, total atomic.Int64

type runtime struct{ echoAddr string }

func (runtime) ExecInContainer(ctx context.Context, name string, uid types.UID, container string,
	cmd []string, in io.Reader, out, errOut io.WriteCloser, tty bool,
	resize <-chan remotecommand.TerminalSize, timeout time.Duration) error {
	return run(cmd, in, out, errOut)
}

func (runtime) AttachContainer(ctx context.Context, name string, uid types.UID, container string,
	in io.Reader, out, errOut io.WriteCloser, tty bool,
	resize <-chan remotecommand.TerminalSize) error {
	if out != nil {
		if _, err := io.WriteString(out, "attached\n"); err != nil {
			return err
		}
	}
	if in == nil {
		return nil
	}
	return run([]string{"cat"}, in, out, errOut)
}

func (r runtime) PortForward(ctx context.Context, name string, uid types.UID, port int32,
	stream io.ReadWriteCloser) error {
	defer stream.Close()
	conn, err := net.Dial("tcp", r.echoAddr)
	if err != nil {
		return err
	}
	defer conn.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(conn, stream); _ = conn.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
	go func() { _, _ = io.Copy(stream, conn); done <- struct{}{} }()
	<-done
	<-done
	return nil
}

// run is the whole "container": a handful of commands, so that no test ever needs a shell.
func run(cmd []string, in io.Reader, out, errOut io.Writer) error {
	if len(cmd) == 0 {
		return fmt.Errorf("no command")
	}
	args := cmd[1:]
	switch cmd[0] {
	case "echo":
		return writeLine(out, args)
	case "warn":
		return writeLine(errOut, args)
	case "cat":
		if in == nil || out == nil {
			return fmt.Errorf("cat needs stdin and stdout")
		}
		_, err := io.Copy(out, in)
		return err
	case "sha256":
		if in == nil {
			return fmt.Errorf("sha256 needs stdin")
		}
		digest := sha256.New()
		n, err := io.Copy(digest, in)
		if err != nil {
			return err
		}
		return writeLine(out, []string{strconv.FormatInt(n, 10), hex.EncodeToString(digest.Sum(nil))})
	case "yes":
		return yes(out, args)
	case "exit":
		code, err := strconv.Atoi(strings.Join(args, ""))
		if err != nil {
			return err
		}
		if code == 0 {
			return nil
		}
		return utilexec.CodeExitError{Err: fmt.Errorf("exit %d", code), Code: code}
	}
	return utilexec.CodeExitError{Err: fmt.Errorf("%s: command not found", cmd[0]), Code: 127}
}

func writeLine(w io.Writer, args []string) error {
	if w == nil {
		return nil
	}
	_, err := io.WriteString(w, strings.Join(args, " ")+"\n")
	return err
}

func yes(out io.Writer, args []string) error {
	if len(args) != 1 || out == nil {
		return fmt.Errorf("yes N needs stdout")
	}
	left, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil {
		return err
	}
	block := []byte(strings.Repeat(pattern, 65536/len(pattern)+1))
	for left > 0 {
		n := min(left, int64(65536))
		if _, err := out.Write(block[:n]); err != nil {
			return err
		}
		left -= n
	}
	return nil
}

func counted(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		open.Add(1)
		total.Add(1)
		defer open.Add(-1)
		next(w, req)
	}
}

// podPath splits /<verb>/<namespace>/<pod>[/<container>] (the apiserver's kubelet URLs).
func podPath(path string) []string {
	return strings.Split(strings.Trim(path, "/"), "/")
}

func serveExec(rt runtime) http.HandlerFunc {
	return counted(func(w http.ResponseWriter, req *http.Request) {
		parts := podPath(req.URL.Path)
		if len(parts) != 4 {
			http.Error(w, "want /exec/<namespace>/<pod>/<container>", http.StatusNotFound)
			return
		}
		opts, err := streamremote.NewOptions(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		streamremote.ServeExec(w, req, rt, parts[2], "", parts[3], req.URL.Query()["command"], opts,
			idleTimeout, streamCreationTimeout, remotecommandconsts.SupportedStreamingProtocols)
	})
}

func serveAttach(rt runtime) http.HandlerFunc {
	return counted(func(w http.ResponseWriter, req *http.Request) {
		parts := podPath(req.URL.Path)
		if len(parts) != 4 {
			http.Error(w, "want /attach/<namespace>/<pod>/<container>", http.StatusNotFound)
			return
		}
		opts, err := streamremote.NewOptions(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		streamremote.ServeAttach(w, req, rt, parts[2], "", parts[3], opts, idleTimeout,
			streamCreationTimeout, remotecommandconsts.SupportedStreamingProtocols)
	})
}

func servePortForward(rt runtime) http.HandlerFunc {
	return counted(func(w http.ResponseWriter, req *http.Request) {
		parts := podPath(req.URL.Path)
		if len(parts) < 3 {
			http.Error(w, "want /portForward/<namespace>/<pod>", http.StatusNotFound)
			return
		}
		opts, err := portforward.NewV4Options(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		portforward.ServePortForward(w, req, rt, parts[2], "", opts, idleTimeout,
			streamCreationTimeout, portforward.SupportedProtocols)
	})
}

func serveStats(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]int64{"open": open.Load(), "total": total.Load()})
}

func echoServer() (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				_, _ = io.Copy(conn, conn)
			}()
		}
	}()
	return ln, nil
}

// selfSigned is the kubelet's own fallback: a self-signed serving cert (the apiserver verifies
// it only with --kubelet-certificate-authority, which the e2e cluster does not set).
func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "opgate-fake-kubelet"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, &tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

func main() {
	if err := serve(); err != nil {
		fmt.Fprintln(os.Stderr, "opgate-fake-kubelet:", err)
		os.Exit(1)
	}
}

func serve() error {
	echo, err := echoServer()
	if err != nil {
		return err
	}
	cert, err := selfSigned()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	rt := runtime{echoAddr: echo.Addr().String()}
	mux := http.NewServeMux()
	mux.HandleFunc("/exec/", serveExec(rt))
	mux.HandleFunc("/attach/", serveAttach(rt))
	mux.HandleFunc("/portForward/", servePortForward(rt))
	mux.HandleFunc("/stats", serveStats)
	// HTTP/1.1 only: SPDY and WebSocket upgrades need it (the real kubelet's server does too)
	srv := &http.Server{Handler: mux, TLSConfig: &tls.Config{
		Certificates: []tls.Certificate{cert}, NextProtos: []string{"http/1.1"}}}
	line, _ := json.Marshal(map[string]int{
		"port": ln.Addr().(*net.TCPAddr).Port, "echo_port": echo.Addr().(*net.TCPAddr).Port})
	fmt.Println(string(line))
	return srv.Serve(tls.NewListener(ln, srv.TLSConfig))
}
