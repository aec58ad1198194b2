package cbserve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/health" // client-side health checking (serviceConfig's healthCheckConfig)
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// DefaultTimeout is the default deadline of unary calls (Submit, Cancel, ModelInfo, and the
// admin Stop, Start, Status); see WithDefaultTimeout.
const DefaultTimeout = 60 * time.Second

// DefaultStreamTimeout is the default deadline of streaming calls (Generate, Stream, Results);
// see WithStreamTimeout.
const DefaultStreamTimeout = 10 * time.Minute

// DefaultRetryAttempts is how many times a call that can be retried (ModelInfo, Cancel, admin
// Status, Generate, GenerateN, Stream) is tried when it fails with ErrUnavailable; see
// WithRetryAttempts.
const DefaultRetryAttempts = 4

// Option configures a connection made by NewClient or NewAdmin.
type Option struct {
	apply func(*dialConfig)
}

type dialConfig struct {
	creds          credentials.TransportCredentials
	token          string
	timeout        time.Duration
	streamTimeout  time.Duration
	retryAttempts  int
	keepalive      *keepalive.ClientParameters
	dialOpts       []grpc.DialOption
	optionFailures []string
}

// WithTLS connects over TLS with the given configuration (nil: the system's root CAs and the
// target's host name). For mutual TLS, set its Certificates.
func WithTLS(config *tls.Config) Option {
	if config == nil {
		config = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return WithTransportCredentials(credentials.NewTLS(config))
}

// WithTransportCredentials connects with the given gRPC transport credentials (TLS from
// credentials.NewClientTLSFromFile, ALTS, ...).
func WithTransportCredentials(creds credentials.TransportCredentials) Option {
	return Option{func(c *dialConfig) { c.creds = creds }}
}

// WithInsecure connects in plaintext (the default).
func WithInsecure() Option {
	return Option{func(c *dialConfig) { c.creds = insecure.NewCredentials() }}
}

// WithBearerToken sends "authorization: Bearer <token>" with every call (also in plaintext:
// use TLS beyond a trusted network).
func WithBearerToken(token string) Option {
	return Option{func(c *dialConfig) { c.token = token }}
}

// WithDefaultTimeout sets the deadline of unary calls (Submit, Cancel, ModelInfo, admin Stop,
// Start and Status, and the wait of admin Pause for the engine to pause) whose context has
// none; 0 means no deadline. Default: DefaultTimeout. A context's own deadline always wins:
// it is how one call gets a deadline other than the client's.
func WithDefaultTimeout(d time.Duration) Option {
	return Option{func(c *dialConfig) { c.timeout = d }}
}

// WithStreamTimeout sets the deadline of streaming calls (Generate, Stream, Results) whose
// context has none, so that a stalled server cannot hold a call forever; 0 means no deadline.
// The deadline covers the whole call, so it also caps how long one generation may run. Default:
// DefaultStreamTimeout. A context's own deadline always wins, longer or shorter.
func WithStreamTimeout(d time.Duration) Option {
	return Option{func(c *dialConfig) { c.streamTimeout = d }}
}

// WithRetryAttempts sets how many times a call is tried when it fails with ErrUnavailable
// (a replica unreachable, loading, draining or restarting) where a retry cannot repeat work:
// ModelInfo, Cancel and admin Status, by gRPC's retry policy; Generate, GenerateN and Stream, by
// this package, when nothing was yielded yet (see Client.Stream). Backoff between tries is
// exponential from 100 ms to 1 s; n is in [1, 5] (gRPC's cap), 1 turns retries off. Default:
// DefaultRetryAttempts. Submit has retries of its own (see Client.Submit); Results is never
// retried (a request lives on the one replica that queued it).
func WithRetryAttempts(n int) Option {
	return Option{func(c *dialConfig) {
		if n < 1 || n > 5 {
			c.optionFailures = append(c.optionFailures, fmt.Sprintf("WithRetryAttempts: %d is not in [1, 5]", n))
		}
		c.retryAttempts = n
	}}
}

// WithKeepalive pings the server after interval without activity on a connection that has
// calls open, and closes the connection (failing its calls with ErrUnavailable) when no answer
// comes within timeout. It finds a dead server or a dropped middlebox connection under a long,
// quiet stream (a request queued or paused) in interval + timeout rather than at the deadline.
// Default: off. The server must accept pings that often: a gRPC server by default accepts one
// ping per 5 minutes on a connection that sends no data, and closes a connection that pings
// more often ("too_many_pings"), failing its calls; interval is at least 10 s (gRPC's minimum).
func WithKeepalive(interval, timeout time.Duration) Option {
	return Option{func(c *dialConfig) {
		c.keepalive = &keepalive.ClientParameters{Time: interval, Timeout: timeout}
	}}
}

// WithDialOptions adds options to the underlying grpc.NewClient call (interceptors, a stats
// handler for tracing, ...). They come after this package's own, so a
// grpc.WithDefaultServiceConfig here replaces the load balancing, health checking and retry
// policy of NewClient.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return Option{func(c *dialConfig) { c.dialOpts = append(c.dialOpts, opts...) }}
}

// bearerToken sends the token on every call; plaintext is allowed, as the server's admin port
// may run without TLS on a trusted network.
type bearerToken string

func (t bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

func (bearerToken) RequireTransportSecurity() bool { return false }

// serviceConfig spreads calls over every address the target resolves to (round_robin: one
// connection per address, each call on the next ready one, dead addresses skipped) and retries
// the idempotent unary calls on UNAVAILABLE, which the server answers when it did nothing. With
// healthChecked, a connection counts as ready only while the server's grpc.health.v1 service says
// SERVING (gRPC's client-side health checking, which needs the health package imported), so
// round_robin passes over a replica that is up but still loading, draining, asleep or without
// complete weights: the generation client's. The admin client's connections are not health
// checked: admin calls are for a replica in any state (waking one that sleeps, say).
func serviceConfig(retryAttempts int, healthChecked bool) string {
	const config = `{
	"loadBalancingConfig": [{"round_robin": {}}],%s
	"methodConfig": [{
		"name": [
			{"service": "cbserve.v1.GenerationService", "method": "GetModelInfo"},
			{"service": "cbserve.v1.GenerationService", "method": "Cancel"},
			{"service": "cbserve.v1.AdminService", "method": "GetStatus"}
		]%s
	}]
}`
	health := ""
	if healthChecked {
		health = `
	"healthCheckConfig": {"serviceName": ""},`
	}
	retry := ""
	if retryAttempts > 1 {
		retry = fmt.Sprintf(`,
		"retryPolicy": {
			"maxAttempts": %d,
			"initialBackoff": "0.1s",
			"maxBackoff": "1s",
			"backoffMultiplier": 2,
			"retryableStatusCodes": ["UNAVAILABLE"]
		}`, retryAttempts)
	}
	return fmt.Sprintf(config, health, retry)
}

// staticScheme names the resolver of a comma-separated list of addresses; it is registered on
// each connection only (grpc.WithResolvers), never globally.
const staticScheme = "cbserve-static"

// staticAddresses returns the addresses of a target that lists several ("host:port,host:port",
// optionally after "ipv4:" or "ipv6:", gRPC's own spelling of such lists), or nil for any other
// target, which gRPC resolves itself.
func staticAddresses(target string) ([]resolver.Address, error) {
	list := target
	for _, scheme := range []string{"ipv4:", "ipv6:"} {
		list = strings.TrimPrefix(list, scheme)
	}
	if !strings.Contains(list, ",") || strings.Contains(list, "/") {
		return nil, nil // one address, or a URI such as "dns:///name:port": gRPC's to resolve
	}
	var addresses []resolver.Address
	for _, address := range strings.Split(list, ",") {
		address = strings.TrimSpace(address)
		if _, _, err := net.SplitHostPort(address); err != nil {
			return nil, fmt.Errorf("address %q of the list: %v (want host:port)", address, err)
		}
		addresses = append(addresses, resolver.Address{Addr: address})
	}
	return addresses, nil
}

// newConn makes the connection of NewClient (healthChecked) or NewAdmin.
func newConn(target string, healthChecked bool, opts []Option) (*grpc.ClientConn, dialConfig, error) {
	cfg := dialConfig{
		creds:         insecure.NewCredentials(),
		timeout:       DefaultTimeout,
		streamTimeout: DefaultStreamTimeout,
		retryAttempts: DefaultRetryAttempts,
	}
	for _, opt := range opts {
		if opt.apply != nil {
			opt.apply(&cfg)
		}
	}
	if len(cfg.optionFailures) > 0 {
		return nil, cfg, newError(codes.InvalidArgument, "%s", strings.Join(cfg.optionFailures, "; "))
	}
	dialOpts := []grpc.DialOption{
		grpc.WithTransportCredentials(cfg.creds),
		grpc.WithDefaultServiceConfig(serviceConfig(cfg.retryAttempts, healthChecked)),
	}
	if cfg.token != "" {
		dialOpts = append(dialOpts, grpc.WithPerRPCCredentials(bearerToken(cfg.token)))
	}
	if cfg.keepalive != nil {
		dialOpts = append(dialOpts, grpc.WithKeepaliveParams(*cfg.keepalive))
	}
	addresses, err := staticAddresses(target)
	if err != nil {
		return nil, cfg, newError(codes.InvalidArgument, "dial %q: %v", target, err)
	}
	grpcTarget := target
	if addresses != nil {
		static := manual.NewBuilderWithScheme(staticScheme)
		static.InitialState(resolver.State{Addresses: addresses})
		dialOpts = append(dialOpts, grpc.WithResolvers(static))
		// The authority (the :authority header, and the TLS server name) is the first address.
		dialOpts = append(dialOpts, grpc.WithAuthority(addresses[0].Addr))
		grpcTarget = staticScheme + ":///addresses"
	}
	dialOpts = append(dialOpts, cfg.dialOpts...)
	conn, err := grpc.NewClient(grpcTarget, dialOpts...)
	if err != nil {
		return nil, cfg, newError(codes.InvalidArgument, "dial %q: %v", target, err)
	}
	conn.Connect()
	return conn, cfg, nil
}

func (c dialConfig) unaryDeadline() clientTimeout {
	return clientTimeout{d: c.timeout, option: "WithDefaultTimeout", kind: "default timeout"}
}

func (c dialConfig) streamDeadline() clientTimeout {
	return clientTimeout{d: c.streamTimeout, option: "WithStreamTimeout", kind: "stream timeout"}
}

// clientTimeout is a deadline the client gives the calls whose context has none, and the option
// that sets it, which a passed deadline names.
type clientTimeout struct {
	d      time.Duration // 0: no deadline
	option string        // "WithDefaultTimeout" or "WithStreamTimeout"
	kind   string        // "default timeout" or "stream timeout"
}

// of returns the deadline a call with context ctx runs under: ctx's, or else the client's.
func (t clientTimeout) of(ctx context.Context) callDeadline {
	now := time.Now()
	if deadline, ok := ctx.Deadline(); ok {
		return callDeadline{ctx: ctx, deadline: deadline, budget: deadline.Sub(now), timeout: t, fromContext: true}
	}
	if t.d <= 0 {
		return callDeadline{ctx: ctx, timeout: t}
	}
	return callDeadline{ctx: ctx, deadline: now.Add(t.d), budget: t.d, timeout: t}
}

// start bounds ctx with the client's timeout unless ctx has a deadline, and returns the deadline
// the call runs under, whose error method converts the call's errors.
func (t clientTimeout) start(ctx context.Context) (context.Context, context.CancelFunc, callDeadline) {
	d := t.of(ctx)
	if d.fromContext || d.deadline.IsZero() {
		callCtx, cancel := context.WithCancel(ctx)
		return callCtx, cancel, d
	}
	callCtx, cancel := context.WithDeadline(ctx, d.deadline)
	return callCtx, cancel, d
}

// callDeadline is the deadline one call runs under: its caller's context's, or the client's
// timeout when the context has none.
type callDeadline struct {
	ctx         context.Context // the caller's
	deadline    time.Time       // zero: none
	budget      time.Duration   // how long the call had when it began
	timeout     clientTimeout
	fromContext bool
}

// error converts an error of the call (convertError). When the call's own deadline has passed,
// the message says which deadline it was, how long the call had, and what sets it, in place of
// gRPC's "Deadline Exceeded" or of where gRPC was waiting at the time (a server's own
// DEADLINE_EXCEEDED, before the call's deadline, keeps the server's message).
func (d callDeadline) error(err error) error {
	converted := convertError(d.ctx, err)
	var e *Error
	if !errors.As(converted, &e) || e.Code != codes.DeadlineExceeded || d.deadline.IsZero() || time.Now().Before(d.deadline) {
		return converted
	}
	budget := d.budget.Round(time.Millisecond)
	switch {
	case d.fromContext && d.timeout.option == "":
		e.Message = fmt.Sprintf("the deadline of the call's context passed, %s after the call began: "+
			"give the context a later one for a longer call", budget)
	case d.fromContext:
		e.Message = fmt.Sprintf("the deadline of the call's context passed, %s after the call began "+
			"(it replaces the client's %s for this call): give the context a later one for a longer call", budget, d.timeout.option)
	default:
		e.Message = fmt.Sprintf("the client's %s of %s passed: %s sets it (0: none), "+
			"and a deadline on the call's context replaces it for one call", d.timeout.kind, budget, d.timeout.option)
	}
	return e
}
