package cbserve

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
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

// DefaultRetryAttempts is how many times an idempotent unary call (ModelInfo, Cancel, admin
// Status) is tried when the server answers ErrUnavailable; see WithRetryAttempts.
const DefaultRetryAttempts = 4

// Option configures a connection made by Dial or DialAdmin.
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

// WithRetryAttempts sets how many times ModelInfo, Cancel and admin Status are tried when the
// server answers ErrUnavailable (unreachable, loading, another replica restarting), with gRPC's
// exponential backoff from 100 ms to 1 s between tries; in [1, 5] (gRPC's cap), 1 turns retries
// off. Default: DefaultRetryAttempts. Submit has retries of its own (see Client.Submit);
// Generate, Stream and Results are never retried.
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
// grpc.WithDefaultServiceConfig here replaces the load balancing and retry policy of Dial.
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
// the idempotent unary calls on UNAVAILABLE, which the server answers when it did nothing.
func serviceConfig(retryAttempts int) string {
	const config = `{
	"loadBalancingConfig": [{"round_robin": {}}],
	"methodConfig": [{
		"name": [
			{"service": "cbserve.v1.GenerationService", "method": "GetModelInfo"},
			{"service": "cbserve.v1.GenerationService", "method": "Cancel"},
			{"service": "cbserve.v1.AdminService", "method": "GetStatus"}
		]%s
	}]
}`
	if retryAttempts <= 1 {
		return fmt.Sprintf(config, "")
	}
	return fmt.Sprintf(config, fmt.Sprintf(`,
		"retryPolicy": {
			"maxAttempts": %d,
			"initialBackoff": "0.1s",
			"maxBackoff": "1s",
			"backoffMultiplier": 2,
			"retryableStatusCodes": ["UNAVAILABLE"]
		}`, retryAttempts))
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

func dial(ctx context.Context, target string, opts []Option) (*grpc.ClientConn, dialConfig, error) {
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
	if err := ctx.Err(); err != nil {
		return nil, cfg, convertError(ctx, err)
	}
	dialOpts := []grpc.DialOption{
		grpc.WithTransportCredentials(cfg.creds),
		grpc.WithDefaultServiceConfig(serviceConfig(cfg.retryAttempts)),
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

// withTimeout bounds ctx with the default timeout unless it already has a deadline.
func withTimeout(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, timeout)
}
