package cbserve_test

// The tests and examples run against a real cbserve server: TestMain saves a tiny random Llama
// with a byte-level tokenizer (scripts/make_tiny_model.py: vocab 256, every byte is a token, no
// EOS, so greedy requests always run to their max new tokens), serves it with
// `python3 -m service serve` from the repository root on two free loopback ports, waits for
// grpc.health.v1 to report SERVING, runs the tests, and stops the server (SIGTERM, then SIGKILL).
// $CBSERVE_TEST_PYTHON overrides the interpreter. Tests that need servers of their own (the
// load-balancing test's replicas) start them with startServer.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

const (
	adminToken     = "test-token"
	startupTimeout = 120 * time.Second
	stopTimeout    = 15 * time.Second
)

// The server's addresses, the folder of its model (config, safetensors weights, tokenizer), the
// Python interpreter and the repository root, set by TestMain.
var (
	serverAddr     string
	adminAddr      string
	modelDir       string
	python         string
	repositoryRoot string
)

func TestMain(m *testing.M) {
	os.Exit(runWithServer(m))
}

func runWithServer(m *testing.M) int {
	started := time.Now()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		return fatal("repository root: %v", err)
	}
	repositoryRoot = root
	python = os.Getenv("CBSERVE_TEST_PYTHON")
	if python == "" {
		python = "python3"
	}
	dir, err := os.MkdirTemp("", "cbserve-go-sdk-")
	if err != nil {
		return fatal("temp dir: %v", err)
	}
	defer os.RemoveAll(dir)

	modelDir = filepath.Join(dir, "model")
	ctx, cancel := context.WithTimeout(context.Background(), startupTimeout)
	defer cancel()
	makeModel := exec.CommandContext(ctx, python, filepath.Join("scripts", "make_tiny_model.py"), modelDir)
	makeModel.Dir = root
	if out, err := makeModel.CombinedOutput(); err != nil {
		return fatal("scripts/make_tiny_model.py: %v\n%s", err, out)
	}

	// Ctrl-C or a SIGTERM to the test binary still stops the servers.
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	go func() {
		if _, ok := <-signals; ok {
			stopAllServers()
			os.Exit(130)
		}
	}()
	server, err := startServer(ctx, filepath.Join(dir, "server.log"))
	if err != nil {
		return fatal("%v", err)
	}
	defer server.stop()
	serverAddr, adminAddr = server.addr, server.adminAddr
	fmt.Fprintf(os.Stderr, "cbserve test server ready on %s (admin %s) after %.1f s\n",
		serverAddr, adminAddr, time.Since(started).Seconds())

	code := m.Run()
	if code != 0 {
		printLogTail(server.logPath)
	}
	return code
}

// testServer is one `cbserve serve` process on two free loopback ports.
type testServer struct {
	addr, adminAddr string
	logPath         string
	cmd             *exec.Cmd
	exited          chan struct{} // closed once the process has exited
	exitState       string        // how it exited, once exited is closed
	stopOnce        sync.Once
}

// The servers started and not yet stopped, for the signal handler.
var (
	serversMu sync.Mutex
	servers   = map[*testServer]bool{}
)

// startServer starts `python3 -m service serve` on modelDir from the repository root, with the
// admin token adminToken, logging to logPath, and waits until it reports SERVING (bounded by ctx).
// Stop it with stop.
func startServer(ctx context.Context, logPath string) (*testServer, error) {
	ports, err := freePorts(2)
	if err != nil {
		return nil, fmt.Errorf("free ports: %w", err)
	}
	server, err := launchServer(logPath, ports)
	if err != nil {
		return nil, err
	}
	if err := server.waitServing(ctx); err != nil {
		return nil, err
	}
	return server, nil
}

// launchServer starts the server of startServer on the given ports (generation, admin) and
// returns at once: its ports open, and its health says NOT_SERVING, while the model loads.
func launchServer(logPath string, ports []int) (*testServer, error) {
	server := &testServer{
		addr:      net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0])),
		adminAddr: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1])),
		logPath:   logPath,
		exited:    make(chan struct{}),
	}
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("server log: %w", err)
	}
	defer logFile.Close()
	server.cmd = exec.Command(python, "-m", "service", "serve",
		"--model", modelDir, "--host", "127.0.0.1",
		"--port", strconv.Itoa(ports[0]), "--admin-port", strconv.Itoa(ports[1]),
		"--num-blocks", "256", "--page-size", "16", "--grace-period", "5")
	server.cmd.Dir = repositoryRoot
	server.cmd.Env = append(os.Environ(), "CBSERVE_ADMIN_TOKEN="+adminToken)
	server.cmd.Stdout, server.cmd.Stderr = logFile, logFile
	killWithParent(server.cmd)
	// The parent-death signal fires when the OS thread that started the child exits, not the
	// process: start the server from a goroutine locked to its thread, which lives until the
	// server has exited (Go ends a locked thread only with its goroutine).
	startErr := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := server.cmd.Start(); err != nil {
			startErr <- err
			return
		}
		startErr <- nil
		err := server.cmd.Wait()
		server.exitState = fmt.Sprint(err)
		if err == nil {
			server.exitState = "exit status 0"
		}
		close(server.exited)
	}()
	if err := <-startErr; err != nil {
		return nil, fmt.Errorf("start the server: %w", err)
	}
	serversMu.Lock()
	servers[server] = true
	serversMu.Unlock()
	return server, nil
}

// waitServing waits until the server reports SERVING (bounded by ctx); if it does not, it stops
// the server and says why.
func (s *testServer) waitServing(ctx context.Context) error {
	if err := waitServing(ctx, s.addr, s.exited); err != nil {
		printLogTail(s.logPath)
		select {
		case <-s.exited:
			err = fmt.Errorf("%w: %s", err, s.exitState)
		default:
		}
		s.stop()
		return fmt.Errorf("the server did not become ready: %w", err)
	}
	return nil
}

// stop sends SIGTERM and waits for the server to exit, killing it after stopTimeout. Idempotent.
func (s *testServer) stop() {
	s.stopOnce.Do(func() {
		stopServer(s.cmd, s.exited)
		serversMu.Lock()
		delete(servers, s)
		serversMu.Unlock()
	})
}

// kill ends the server at once (SIGKILL), as a crash would, and waits for it to exit.
func (s *testServer) kill() {
	s.stopOnce.Do(func() {
		_ = s.cmd.Process.Kill()
		<-s.exited
		serversMu.Lock()
		delete(servers, s)
		serversMu.Unlock()
	})
}

func stopAllServers() {
	serversMu.Lock()
	var running []*testServer
	for server := range servers {
		running = append(running, server)
	}
	serversMu.Unlock()
	for _, server := range running {
		server.stop()
	}
}

func fatal(format string, args ...any) int {
	fmt.Fprintf(os.Stderr, "TestMain: "+format+"\n", args...)
	return 1
}

// freePorts returns n distinct free loopback ports (the listeners are held until all are chosen).
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// waitServing polls grpc.health.v1 until the server reports SERVING, it exits, or ctx ends.
func waitServing(ctx context.Context, target string, exited <-chan struct{}) error {
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	last := "no answer"
	for {
		callCtx, cancel := context.WithTimeout(ctx, time.Second)
		response, err := health.Check(callCtx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && response.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if err != nil {
			last = err.Error()
		} else {
			last = response.GetStatus().String()
		}
		select {
		case <-exited:
			return fmt.Errorf("the server exited (last health check: %s)", last)
		case <-ctx.Done():
			return fmt.Errorf("%w (last health check: %s)", ctx.Err(), last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// stopServer sends SIGTERM and waits for the server to exit, killing it after stopTimeout.
func stopServer(server *exec.Cmd, exited <-chan struct{}) {
	select {
	case <-exited:
		return
	default:
	}
	if err := server.Process.Signal(syscall.SIGTERM); err != nil {
		_ = server.Process.Kill()
	}
	select {
	case <-exited:
	case <-time.After(stopTimeout):
		fmt.Fprintf(os.Stderr, "TestMain: the server did not exit within %s of SIGTERM; killing it\n", stopTimeout)
		_ = server.Process.Kill()
		<-exited
	}
}

func printLogTail(path string) {
	data, err := os.ReadFile(path)
	if err != nil {
		return
	}
	var lines []string
	scanner := bufio.NewScanner(bytes.NewReader(data))
	scanner.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for scanner.Scan() {
		lines = append(lines, scanner.Text())
	}
	if len(lines) > 60 {
		lines = lines[len(lines)-60:]
	}
	fmt.Fprintf(os.Stderr, "--- last lines of the server log (%s) ---\n", path)
	for _, line := range lines {
		fmt.Fprintln(os.Stderr, line)
	}
	fmt.Fprintln(os.Stderr, "--- end of the server log ---")
}
