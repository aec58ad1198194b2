package cbserve_test

// Client behaviour checked against an in-process fake GenerationService (no Python server):
// TLS, the bearer token, the default timeout, Submit's retries, and what Generate sends and
// makes of scripted chunks.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"maps"
	"math/big"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	cbserve "github.com/cbserve/cbserve/sdk/go"
	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

type fakeGeneration struct {
	pb.UnimplementedGenerationServiceServer
	mu           sync.Mutex
	calls        int      // calls received, of any method
	auth         []string // authorization metadata of each call
	addIDs       []string // request ids of each AddRequest
	addErrors    []error  // what the next AddRequest calls answer (nil: OK)
	infoErrors   []error  // what the next GetModelInfo calls answer (nil: OK)
	cancelErrors []error  // what the next Cancel calls answer (nil: OK)
	infoDelay    time.Duration
	stall        bool // Generate and StreamResults send nothing until the call ends
	// What the next Generate calls end with before they send anything (nil: they run on), and then
	// how many more are refused with an UNAVAILABLE chunk, as a draining server refuses a request.
	generateErrors []error
	rejectNext     int
	// What the next Generate calls that run end with after their first chunk (nil: they finish).
	midStreamErrors []error
	generated       []*pb.GenerationRequest // the request added by each Generate call
	added           []*pb.GenerationRequest // the request of each AddRequest
	cancels         []*pb.CancelRequest     // each Cancel call's request
	// What each Generate call answers, under its request's id: for a request of n > 1 sequences,
	// each chunk once per sequence (Index 0 to n - 1) unless some chunk has an index of its own,
	// in which case the chunks go as they are.
	chunks []*pb.GenerationChunk
}

// generatedRequests returns the request of each Generate call so far.
func (f *fakeGeneration) generatedRequests() []*pb.GenerationRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.generated)
}

func (f *fakeGeneration) callCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// nextError pops the first of a scripted list of answers (nil: OK).
func (f *fakeGeneration) nextError(answers *[]error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(*answers) == 0 {
		return nil
	}
	err := (*answers)[0]
	*answers = (*answers)[1:]
	return err
}

func (f *fakeGeneration) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.auth = append(f.auth, md.Get("authorization")...)
}

func (f *fakeGeneration) GetModelInfo(ctx context.Context, _ *pb.GetModelInfoRequest) (*pb.GetModelInfoResponse, error) {
	f.record(ctx)
	if err := f.nextError(&f.infoErrors); err != nil {
		return nil, err
	}
	select {
	case <-time.After(f.infoDelay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &pb.GetModelInfoResponse{ModelName: "fake", VocabSize: 7}, nil
}

func (f *fakeGeneration) AddRequest(ctx context.Context, r *pb.AddRequestRequest) (*pb.AddRequestResponse, error) {
	f.record(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.addIDs = append(f.addIDs, r.GetRequest().GetRequestId())
	f.added = append(f.added, r.GetRequest())
	if len(f.addErrors) > 0 {
		err := f.addErrors[0]
		f.addErrors = f.addErrors[1:]
		if err != nil {
			return nil, err
		}
	}
	return &pb.AddRequestResponse{RequestId: r.GetRequest().GetRequestId()}, nil
}

func (f *fakeGeneration) Cancel(ctx context.Context, r *pb.CancelRequest) (*pb.CancelResponse, error) {
	f.record(ctx)
	f.mu.Lock()
	f.cancels = append(f.cancels, r)
	f.mu.Unlock()
	if err := f.nextError(&f.cancelErrors); err != nil {
		return nil, err
	}
	return &pb.CancelResponse{Cancelled: true}, nil
}

func (f *fakeGeneration) StreamResults(_ *pb.StreamResultsRequest, stream pb.GenerationService_StreamResultsServer) error {
	f.record(stream.Context())
	if f.stall {
		<-stream.Context().Done()
	}
	return stream.Context().Err()
}

// Generate records the request of the stream's first add message and answers f.chunks, then
// ends the call as the server does once the request has ended. A session's options come first:
// its chunks then go batched.
func (f *fakeGeneration) Generate(stream pb.GenerationService_GenerateServer) error {
	f.record(stream.Context())
	message, err := stream.Recv()
	if err != nil {
		return err
	}
	batched := message.GetOptions().GetBatchChunks()
	if message.GetOptions() != nil {
		if message, err = stream.Recv(); err != nil {
			return err
		}
	}
	send := func(chunk *pb.GenerationChunk) error {
		if batched {
			return stream.Send(&pb.GenerateResponse{Chunks: []*pb.GenerationChunk{chunk}})
		}
		return stream.Send(&pb.GenerateResponse{Chunk: chunk})
	}
	request := message.GetAdd()
	f.mu.Lock()
	f.generated = append(f.generated, request)
	chunks := f.chunks
	reject := f.rejectNext > 0 && len(f.generateErrors) == 0
	if reject {
		f.rejectNext--
	}
	f.mu.Unlock()
	if err := f.nextError(&f.generateErrors); err != nil {
		return err
	}
	if reject {
		return send(&pb.GenerationChunk{
			RequestId: request.GetRequestId(), Status: pb.RequestStatus_REQUEST_STATUS_FAILED,
			FinishReason: pb.FinishReason_FINISH_REASON_ERROR, Error: "the server is stopped or draining",
			ErrorCode: uint32(codes.Unavailable),
		})
	}
	midStreamError := f.nextError(&f.midStreamErrors)
	if f.stall {
		<-stream.Context().Done()
		return stream.Context().Err()
	}
	sequences := max(1, request.GetSampling().GetN())
	if slices.ContainsFunc(chunks, func(c *pb.GenerationChunk) bool { return c.GetIndex() != 0 }) {
		sequences = 1 // scripted per sequence
	}
	for _, scripted := range chunks {
		for index := range sequences {
			chunk := proto.CloneOf(scripted) // f.chunks is shared by every call
			chunk.RequestId = request.GetRequestId()
			if sequences > 1 {
				chunk.Index = index
			}
			if err := send(chunk); err != nil {
				return err
			}
			if midStreamError != nil {
				return midStreamError
			}
		}
	}
	return nil
}

// startFake serves f on a loopback port (with TLS when creds is set) until the test ends.
func startFake(t *testing.T, f *fakeGeneration, creds credentials.TransportCredentials) string {
	t.Helper()
	var opts []grpc.ServerOption
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	return startFakeWith(t, f, nil, opts...)
}

// startFakeWith is startFake with more services, registered by register; nil registers a
// grpc.health.v1 service that says SERVING, as a cbserve server with its model loaded does.
func startFakeWith(t *testing.T, f *fakeGeneration, register func(*grpc.Server), opts ...grpc.ServerOption) string {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer(opts...)
	pb.RegisterGenerationServiceServer(server, f)
	if register == nil {
		register = func(s *grpc.Server) { healthpb.RegisterHealthServer(s, grpchealth.NewServer()) }
	}
	register(server)
	go func() { _ = server.Serve(listener) }()
	t.Cleanup(server.Stop)
	return listener.Addr().String()
}

// selfSigned returns a server certificate for 127.0.0.1 and a pool that trusts it.
func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	template := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "cbserve test"},
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert}, pool
}

func TestTLSAndBearerToken(t *testing.T) {
	cert, pool := selfSigned(t)
	fake := &fakeGeneration{}
	addr := startFake(t, fake, credentials.NewServerTLSFromCert(&cert))
	ctx := testContext(t)

	client, err := cbserve.NewClient(addr, cbserve.WithTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}),
		cbserve.WithBearerToken("s3cret"))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	info, err := client.ModelInfo(ctx)
	if err != nil || info.ModelName != "fake" || info.VocabSize != 7 {
		t.Fatalf("ModelInfo over TLS = %+v, %v", info, err)
	}
	fake.mu.Lock()
	auth := fake.auth
	fake.mu.Unlock()
	if len(auth) != 1 || auth[0] != "Bearer s3cret" {
		t.Errorf("authorization metadata %q; want [\"Bearer s3cret\"]", auth)
	}

	// A plaintext client cannot talk to the TLS server.
	plain, err := cbserve.NewClient(addr, cbserve.WithDefaultTimeout(2*time.Second))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer plain.Close()
	if _, err := plain.ModelInfo(ctx); !errors.Is(err, cbserve.ErrUnavailable) {
		t.Errorf("plaintext call to a TLS server: %v; want ErrUnavailable", err)
	}
}

func TestDefaultTimeout(t *testing.T) {
	addr := startFake(t, &fakeGeneration{infoDelay: 5 * time.Second}, nil)
	client, err := cbserve.NewClient(addr, cbserve.WithDefaultTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	started := time.Now()
	_, err = client.ModelInfo(context.Background())
	if !errors.Is(err, cbserve.ErrDeadlineExceeded) || status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("ModelInfo past the default timeout: %v; want ErrDeadlineExceeded", err)
	}
	if elapsed := time.Since(started); elapsed > 3*time.Second {
		t.Errorf("the call took %s; want about 200 ms", elapsed)
	}
}

func TestSubmitRetries(t *testing.T) {
	unavailable := status.Error(codes.Unavailable, "loading")
	exhausted := status.Error(codes.ResourceExhausted, "queue full")
	exists := status.Error(codes.AlreadyExists, "request id already in use")
	invalid := status.Error(codes.InvalidArgument, "text must not be empty")
	for _, tc := range []struct {
		name      string
		answers   []error
		wantErr   *cbserve.Error
		wantTries int
	}{
		{"unavailable then OK", []error{unavailable, nil}, nil, 2},
		{"queue full twice then OK", []error{exhausted, exhausted, nil}, nil, 3},
		{"always unavailable", []error{unavailable, unavailable, unavailable, nil}, cbserve.ErrUnavailable, 3},
		{"lost answer: already exists on the retry", []error{unavailable, exists}, nil, 2},
		{"already exists at once", []error{exists}, cbserve.ErrAlreadyExists, 1},
		{"invalid: no retry", []error{invalid, nil}, cbserve.ErrInvalidArgument, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := &fakeGeneration{addErrors: tc.answers}
			client, err := cbserve.NewClient(startFake(t, fake, nil))
			if err != nil {
				t.Fatalf("NewClient: %v", err)
			}
			defer client.Close()
			id, err := client.Submit(testContext(t), cbserve.Text("hi"))
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Errorf("Submit: %v; want %v", err, tc.wantErr)
				}
			} else if err != nil || id == "" {
				t.Errorf("Submit = %q, %v; want an id", id, err)
			}
			fake.mu.Lock()
			defer fake.mu.Unlock()
			if len(fake.addIDs) != tc.wantTries {
				t.Errorf("%d AddRequest calls; want %d", len(fake.addIDs), tc.wantTries)
			}
			for _, sent := range fake.addIDs {
				if sent != fake.addIDs[0] || (tc.wantErr == nil && sent != id) {
					t.Errorf("request ids sent %q, returned %q; want one id throughout", fake.addIDs, id)
					break
				}
			}
		})
	}
}

func TestStopStrings(t *testing.T) {
	fake := &fakeGeneration{chunks: []*pb.GenerationChunk{
		{Status: pb.RequestStatus_REQUEST_STATUS_QUEUED},
		{TokenIds: []uint32{'h', 'i', '\n'}, Text: proto.String("hi"), Status: pb.RequestStatus_REQUEST_STATUS_DECODING},
		{TokenIndex: 3, TokenIds: []uint32{'\n'}, Text: proto.String(""), Status: pb.RequestStatus_REQUEST_STATUS_FINISHED,
			FinishReason: pb.FinishReason_FINISH_REASON_STOP, Usage: &pb.Usage{PromptTokens: 2, GeneratedTokens: 4}},
	}}
	client, err := cbserve.NewClient(startFake(t, fake, nil))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	stop := []string{"\n\n", "END", "###"}
	option := cbserve.WithStop(stop...)
	stop[0] = "changed after the option was built" // must not reach the wire
	completion, err := client.Generate(testContext(t), cbserve.Text("hi"), option)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	if completion.FinishReason != cbserve.FinishStop || completion.Text != "hi" ||
		!slices.Equal(completion.TokenIDs, []uint32{'h', 'i', '\n', '\n'}) {
		t.Errorf("Generate = %q %v, finish %q; want \"hi\" with all 4 tokens, stop",
			completion.Text, completion.TokenIDs, completion.FinishReason)
	}

	// Without WithStop no stop string goes on the wire.
	if _, err := client.Generate(testContext(t), cbserve.Text("hi")); err != nil {
		t.Fatalf("Generate: %v", err)
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.generated) != 2 {
		t.Fatalf("%d Generate calls; want 2", len(fake.generated))
	}
	if sent, want := fake.generated[0].GetSampling().GetStop(), []string{"\n\n", "END", "###"}; !slices.Equal(sent, want) {
		t.Errorf("WithStop sent stop %q; want %q", sent, want)
	}
	if sent := fake.generated[1].GetSampling().GetStop(); sent != nil {
		t.Errorf("no WithStop sent stop %q; want none", sent)
	}
}

// dialRecordingFake serves a fake that answers every Generate with "ok" (finished, length) and
// records what it was sent, and returns it with a client connected to it until the test ends.
func dialRecordingFake(t *testing.T) (*fakeGeneration, *cbserve.Client) {
	t.Helper()
	fake := &fakeGeneration{chunks: []*pb.GenerationChunk{
		{Status: pb.RequestStatus_REQUEST_STATUS_QUEUED},
		{TokenIds: []uint32{'o', 'k'}, Text: proto.String("ok"), Status: pb.RequestStatus_REQUEST_STATUS_FINISHED,
			FinishReason: pb.FinishReason_FINISH_REASON_LENGTH, Usage: &pb.Usage{PromptTokens: 2, GeneratedTokens: 2}},
	}}
	client, err := cbserve.NewClient(startFake(t, fake, nil))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return fake, client
}

func TestPenaltiesAndMinNewTokens(t *testing.T) {
	fake, client := dialRecordingFake(t)
	if _, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithRepetitionPenalty(1.25),
		cbserve.WithPresencePenalty(-0.5), cbserve.WithFrequencyPenalty(0.75), cbserve.WithMinNewTokens(3)); err != nil {
		t.Fatalf("Generate with penalties: %v", err)
	}
	// Without the options nothing of them goes on the wire.
	if _, err := client.Generate(testContext(t), cbserve.Text("hi")); err != nil {
		t.Fatalf("Generate: %v", err)
	}

	// A negative min new tokens is refused client-side: no call reaches the server.
	fake.mu.Lock()
	calls := fake.calls
	fake.mu.Unlock()
	_, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithMinNewTokens(-1))
	var e *cbserve.Error
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !errors.As(err, &e) || e.Message != "sampling.min_new_tokens must be an int >= 0, got -1" {
		t.Errorf("Generate with WithMinNewTokens(-1): error %v; want invalid argument: sampling.min_new_tokens must be an int >= 0, got -1", err)
	}
	_, err = client.Submit(testContext(t), cbserve.Text("hi"), cbserve.WithMinNewTokens(-1))
	if !errors.Is(err, cbserve.ErrInvalidArgument) {
		t.Errorf("Submit with WithMinNewTokens(-1): error %v; want invalid argument", err)
	}

	fake.mu.Lock()
	defer fake.mu.Unlock()
	if fake.calls != calls {
		t.Errorf("WithMinNewTokens(-1) made %d calls to the server; want none", fake.calls-calls)
	}
	if len(fake.generated) != 2 {
		t.Fatalf("%d Generate requests reached the server; want 2", len(fake.generated))
	}
	sent := fake.generated[0].GetSampling()
	if sent.RepetitionPenalty == nil || *sent.RepetitionPenalty != 1.25 {
		t.Errorf("WithRepetitionPenalty(1.25) sent %v; want 1.25", sent.RepetitionPenalty)
	}
	if sent.PresencePenalty == nil || *sent.PresencePenalty != -0.5 {
		t.Errorf("WithPresencePenalty(-0.5) sent %v; want -0.5", sent.PresencePenalty)
	}
	if sent.FrequencyPenalty == nil || *sent.FrequencyPenalty != 0.75 {
		t.Errorf("WithFrequencyPenalty(0.75) sent %v; want 0.75", sent.FrequencyPenalty)
	}
	if sent.MinNewTokens == nil || *sent.MinNewTokens != 3 {
		t.Errorf("WithMinNewTokens(3) sent %v; want 3", sent.MinNewTokens)
	}
	unset := fake.generated[1].GetSampling()
	if unset.RepetitionPenalty != nil || unset.PresencePenalty != nil || unset.FrequencyPenalty != nil || unset.MinNewTokens != nil {
		t.Errorf("no options sent repetition %v, presence %v, frequency %v, min new tokens %v; want all unset",
			unset.RepetitionPenalty, unset.PresencePenalty, unset.FrequencyPenalty, unset.MinNewTokens)
	}
}

func TestLogitBias(t *testing.T) {
	fake, client := dialRecordingFake(t)
	bias := map[uint32]float64{'a': -100, 'b': 100, 7: 0.5, 0: -2.25}
	option := cbserve.WithLogitBias(bias)
	bias['a'] = 42 // changes after the option was built must not reach the wire
	bias['z'] = 1
	delete(bias, 7)
	if _, err := client.Generate(testContext(t), cbserve.Text("hi"), option); err != nil {
		t.Fatalf("Generate with WithLogitBias: %v", err)
	}
	// Without WithLogitBias no bias goes on the wire.
	if _, err := client.Generate(testContext(t), cbserve.Text("hi")); err != nil {
		t.Fatalf("Generate: %v", err)
	}

	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.generated) != 2 {
		t.Fatalf("%d Generate requests reached the server; want 2", len(fake.generated))
	}
	want := map[uint32]float32{'a': -100, 'b': 100, 7: 0.5, 0: -2.25}
	if sent := fake.generated[0].GetSampling().GetLogitBias(); !maps.Equal(sent, want) {
		t.Errorf("WithLogitBias sent logit bias %v; want %v", sent, want)
	}
	if sent := fake.generated[1].GetSampling().GetLogitBias(); len(sent) != 0 {
		t.Errorf("no WithLogitBias sent logit bias %v; want none", sent)
	}
}

func TestMinPStopTokensPromptLogprobsPriorityOnTheWire(t *testing.T) {
	fake, client := dialRecordingFake(t)
	stopIDs := []uint32{5, 9}
	option := cbserve.WithStopTokenIDs(stopIDs...)
	stopIDs[0] = 77 // changes after the option was built must not reach the wire
	if _, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithMinP(0.25), option,
		cbserve.WithSkipSpecialTokens(false), cbserve.WithPromptLogprobs(3), cbserve.WithPriority(-3)); err != nil {
		t.Fatalf("Generate with the options: %v", err)
	}
	if _, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithPromptLogprobs(0),
		cbserve.WithSkipSpecialTokens(true)); err != nil {
		t.Fatalf("Generate with WithPromptLogprobs(0): %v", err)
	}
	// Without the options nothing of them goes on the wire.
	if _, err := client.Generate(testContext(t), cbserve.Text("hi")); err != nil {
		t.Fatalf("Generate: %v", err)
	}

	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.generated) != 3 {
		t.Fatalf("%d Generate requests reached the server; want 3", len(fake.generated))
	}
	set := fake.generated[0]
	sent := set.GetSampling()
	if sent.MinP == nil || *sent.MinP != 0.25 {
		t.Errorf("WithMinP(0.25) sent %v; want 0.25", sent.MinP)
	}
	if !slices.Equal(sent.GetStopTokenIds(), []uint32{5, 9}) {
		t.Errorf("WithStopTokenIDs(5, 9) sent %v", sent.GetStopTokenIds())
	}
	if sent.SkipSpecialTokens == nil || *sent.SkipSpecialTokens {
		t.Errorf("WithSkipSpecialTokens(false) sent %v; want false", sent.SkipSpecialTokens)
	}
	if sent.PromptLogprobs == nil || *sent.PromptLogprobs != 3 {
		t.Errorf("WithPromptLogprobs(3) sent %v; want 3", sent.PromptLogprobs)
	}
	if set.GetPriority() != -3 {
		t.Errorf("WithPriority(-3) sent %d", set.GetPriority())
	}
	if sent.StructuredOutput != nil || sent.Logprobs || sent.TopLogprobs != nil {
		t.Errorf("sent structured output %v, logprobs %v, top logprobs %v; want none", sent.StructuredOutput, sent.Logprobs, sent.TopLogprobs)
	}
	zero := fake.generated[1].GetSampling()
	if zero.PromptLogprobs == nil || *zero.PromptLogprobs != 0 || zero.SkipSpecialTokens == nil || !*zero.SkipSpecialTokens {
		t.Errorf("WithPromptLogprobs(0), WithSkipSpecialTokens(true) sent %v, %v; want 0 and true, set", zero.PromptLogprobs, zero.SkipSpecialTokens)
	}
	unset := fake.generated[2]
	if s := unset.GetSampling(); s.MinP != nil || s.StopTokenIds != nil || s.SkipSpecialTokens != nil || s.PromptLogprobs != nil ||
		s.StructuredOutput != nil || unset.GetPriority() != 0 {
		t.Errorf("no options sent min p %v, stop token ids %v, skip special tokens %v, prompt logprobs %v, structured output %v, "+
			"priority %d; want all unset", s.MinP, s.StopTokenIds, s.SkipSpecialTokens, s.PromptLogprobs, s.StructuredOutput, unset.GetPriority())
	}
}

func TestStructuredOutputOnTheWire(t *testing.T) {
	fake, client := dialRecordingFake(t)
	type answer struct {
		Type       string         `json:"type"`
		Properties map[string]any `json:"properties"`
	}
	schemaBytes := []byte(`{"type": "object"}`)
	fromBytes := cbserve.WithJSONSchema(schemaBytes)
	schemaBytes[2] = 'X' // changes after the option was built must not reach the wire
	for _, tc := range []struct {
		option cbserve.GenerateOption
		want   *pb.StructuredOutput
	}{
		{cbserve.WithJSONSchema(`{"type": "string"}`),
			&pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonSchema{JsonSchema: `{"type": "string"}`}}},
		{fromBytes, &pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonSchema{JsonSchema: `{"type": "object"}`}}},
		{cbserve.WithJSONSchema(json.RawMessage(`{"type": "integer"}`)),
			&pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonSchema{JsonSchema: `{"type": "integer"}`}}},
		{cbserve.WithJSONSchema(answer{Type: "object", Properties: map[string]any{"n": map[string]string{"type": "integer"}}}),
			&pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonSchema{
				JsonSchema: `{"type":"object","properties":{"n":{"type":"integer"}}}`}}},
		{cbserve.WithJSONObject(), &pb.StructuredOutput{Constraint: &pb.StructuredOutput_JsonObject{JsonObject: true}}},
		{cbserve.WithRegex(`\d{3}`), &pb.StructuredOutput{Constraint: &pb.StructuredOutput_Regex{Regex: `\d{3}`}}},
		{cbserve.WithGrammar(`root ::= "a" | "b"`), &pb.StructuredOutput{Constraint: &pb.StructuredOutput_Grammar{Grammar: `root ::= "a" | "b"`}}},
	} {
		if _, err := client.Generate(testContext(t), cbserve.Text("hi"), tc.option); err != nil {
			t.Fatalf("Generate with a structured-output option: %v", err)
		}
		fake.mu.Lock()
		sent := fake.generated[len(fake.generated)-1].GetSampling().GetStructuredOutput()
		fake.mu.Unlock()
		if !proto.Equal(sent, tc.want) {
			t.Errorf("sent structured output %v; want %v", sent, tc.want)
		}
	}
}

func TestStopReasonAndPromptLogprobsFromChunks(t *testing.T) {
	fake, client := dialRecordingFake(t)
	promptLogprobs := []*pb.PromptLogprob{
		{TokenId: 'i', Logprob: -1.5, TopLogprobs: []*pb.TopLogprob{{TokenId: 'a', Logprob: -0.5}, {TokenId: 'i', Logprob: -1.5}}},
	}
	fake.mu.Lock()
	fake.chunks = []*pb.GenerationChunk{
		{Status: pb.RequestStatus_REQUEST_STATUS_QUEUED},
		{TokenIds: []uint32{'o'}, Text: proto.String("o"), Status: pb.RequestStatus_REQUEST_STATUS_DECODING, PromptLogprobs: promptLogprobs},
		{TokenIndex: 1, TokenIds: []uint32{0}, Text: proto.String(""), Status: pb.RequestStatus_REQUEST_STATUS_FINISHED,
			FinishReason: pb.FinishReason_FINISH_REASON_STOP, StopReason: &pb.GenerationChunk_StopTokenId{StopTokenId: 0}},
	}
	fake.mu.Unlock()
	var last *cbserve.Chunk
	for chunk, err := range client.Stream(testContext(t), cbserve.Text("hi")) {
		if err != nil {
			t.Fatalf("Stream: %v", err)
		}
		if (len(chunk.PromptLogprobs) > 0) != (chunk.TokenIndex == 0 && len(chunk.TokenIDs) > 0) {
			t.Errorf("chunk %+v: prompt logprobs %v; want them on the first token's chunk only", chunk, chunk.PromptLogprobs)
		}
		last = chunk
	}
	if last.FinishReason != cbserve.FinishStop || last.StopTokenID == nil || *last.StopTokenID != 0 || last.StopString != "" {
		t.Errorf("last chunk: finish %q, stop token %v, stop string %q; want stop, token 0", last.FinishReason, last.StopTokenID, last.StopString)
	}
	completion, err := client.Generate(testContext(t), cbserve.Text("hi"))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	want := []cbserve.PromptLogprob{{TokenID: 'i', Logprob: -1.5, Top: []cbserve.TopLogprob{{TokenID: 'a', Logprob: -0.5}, {TokenID: 'i', Logprob: -1.5}}}}
	if !reflect.DeepEqual(completion.PromptLogprobs, want) {
		t.Errorf("Completion.PromptLogprobs = %+v; want %+v", completion.PromptLogprobs, want)
	}
	if completion.FinishReason != cbserve.FinishStop || completion.StopTokenID == nil || *completion.StopTokenID != 0 || completion.StopString != "" {
		t.Errorf("Completion: finish %q, stop token %v, stop string %q; want stop, token 0", completion.FinishReason, completion.StopTokenID, completion.StopString)
	}

	fake.mu.Lock()
	fake.chunks = []*pb.GenerationChunk{
		{Status: pb.RequestStatus_REQUEST_STATUS_QUEUED},
		{TokenIds: []uint32{'o', 'k', '!'}, Text: proto.String("ok"), Status: pb.RequestStatus_REQUEST_STATUS_FINISHED,
			FinishReason: pb.FinishReason_FINISH_REASON_STOP, StopReason: &pb.GenerationChunk_StopString{StopString: "!"}},
	}
	fake.mu.Unlock()
	completion, err = client.Generate(testContext(t), cbserve.Text("hi"))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	if completion.FinishReason != cbserve.FinishStop || completion.StopTokenID != nil || completion.StopString != "!" || completion.PromptLogprobs != nil {
		t.Errorf("Completion: finish %q, stop token %v, stop string %q, prompt logprobs %v; want stop, string \"!\", no prompt logprobs",
			completion.FinishReason, completion.StopTokenID, completion.StopString, completion.PromptLogprobs)
	}
}

func TestParallelSamplingOnTheWire(t *testing.T) {
	fake, client := dialRecordingFake(t)
	completions, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 3, cbserve.WithSeed(5))
	if err != nil {
		t.Fatalf("GenerateN: %v", err)
	}
	if len(completions) != 3 {
		t.Fatalf("GenerateN(3) returned %d completions", len(completions))
	}
	for i, c := range completions {
		if c.Index != i || c.RequestID == "" || c.RequestID != completions[0].RequestID || c.Text != "ok" ||
			!slices.Equal(c.TokenIDs, []uint32{'o', 'k'}) || c.FinishReason != cbserve.FinishLength || c.Usage == nil {
			t.Errorf("completion %d = %+v; want index %d of one request, \"ok\", length, usage", i, c, i)
		}
	}
	if _, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 2, cbserve.WithN(2)); err != nil {
		t.Errorf("GenerateN(2) with WithN(2): %v", err)
	}
	one, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithN(1))
	if err != nil || one.Index != 0 || one.Text != "ok" {
		t.Errorf("Generate with WithN(1) = %+v, %v; want one completion", one, err)
	}
	if _, err := client.Generate(testContext(t), cbserve.Text("hi")); err != nil {
		t.Fatalf("Generate: %v", err)
	}
	var indices []int
	terminal := map[int]int{}
	for chunk, err := range client.Stream(testContext(t), cbserve.Text("hi"), cbserve.WithN(4)) {
		if err != nil {
			t.Fatalf("Stream with WithN(4): %v", err)
		}
		indices = append(indices, chunk.Index)
		if chunk.Finished() {
			terminal[chunk.Index]++
		}
	}
	if want := []int{0, 1, 2, 3, 0, 1, 2, 3}; !slices.Equal(indices, want) {
		t.Errorf("Stream with WithN(4) yielded chunks of sequences %v; want %v", indices, want)
	}
	if !maps.Equal(terminal, map[int]int{0: 1, 1: 1, 2: 1, 3: 1}) {
		t.Errorf("terminal chunks per sequence %v; want one each", terminal)
	}
	if _, err := client.Submit(testContext(t), cbserve.Text("hi"), cbserve.WithN(5)); err != nil {
		t.Fatalf("Submit with WithN(5): %v", err)
	}

	// Refused before any call: n > 1 on Generate, GenerateN's n out of bounds or disagreeing with WithN.
	calls := fake.callCount()
	for _, tc := range []struct {
		name     string
		call     func() error
		mentions []string
	}{
		{"Generate with WithN(2)", func() error {
			_, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithN(2))
			return err
		}, []string{"WithN(2)", "GenerateN"}},
		{"Generate with WithN(129)", func() error {
			_, err := client.Generate(testContext(t), cbserve.Text("hi"), cbserve.WithN(129))
			return err
		}, []string{"sampling.n must be an int in [1, 128], got 129"}},
		{"GenerateN(0)", func() error {
			_, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 0)
			return err
		}, []string{"sampling.n must be an int in [1, 128], got 0"}},
		{"GenerateN(129)", func() error {
			_, err := client.GenerateN(testContext(t), cbserve.Text("hi"), cbserve.MaxN+1)
			return err
		}, []string{"sampling.n must be an int in [1, 128], got 129"}},
		{"GenerateN(3) with WithN(2)", func() error {
			_, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 3, cbserve.WithN(2))
			return err
		}, []string{"GenerateN(n = 3)", "WithN(2)"}},
		{"GenerateN(2) with a bad option", func() error {
			_, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 2, cbserve.WithTopP(2))
			return err
		}, []string{"sampling.top_p must be a finite number in (0, 1], got 2.0"}},
	} {
		if err := tc.call(); !errors.Is(err, cbserve.ErrInvalidArgument) || !containsAll(err.Error(), tc.mentions...) {
			t.Errorf("%s: %v; want ErrInvalidArgument mentioning %q", tc.name, err, tc.mentions)
		}
	}
	if made := fake.callCount() - calls; made != 0 {
		t.Errorf("refused calls made %d calls; want none", made)
	}

	fake.mu.Lock()
	defer fake.mu.Unlock()
	var sent []*uint32
	for _, r := range fake.generated {
		sent = append(sent, r.GetSampling().N)
	}
	want := []*uint32{proto.Uint32(3), proto.Uint32(2), proto.Uint32(1), nil, proto.Uint32(4)}
	if !slices.EqualFunc(sent, want, func(a, b *uint32) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }) {
		t.Errorf("sampling.n sent %v; want 3, 2, 1, unset, 4", derefAll(sent))
	}
	if seed := fake.generated[0].GetSampling().Seed; seed == nil || *seed != 5 {
		t.Errorf("GenerateN with WithSeed(5) sent seed %v; want 5 (the server derives each sequence's)", seed)
	}
	if n := fake.added[0].GetSampling().N; n == nil || *n != 5 {
		t.Errorf("Submit with WithN(5) sent n %v; want 5", n)
	}
}

// derefAll lists optional values for messages: nil as -1.
func derefAll(values []*uint32) []int64 {
	out := make([]int64, len(values))
	for i, v := range values {
		out[i] = -1
		if v != nil {
			out[i] = int64(*v)
		}
	}
	return out
}

// TestStreamEndsWhenEverySequenceHas: with n > 1 the chunks of the sequences interleave, each
// sequence ends on its own, and Stream and GenerateN end once every sequence has.
func TestStreamEndsWhenEverySequenceHas(t *testing.T) {
	fake, client := dialRecordingFake(t)
	decoding, finished := pb.RequestStatus_REQUEST_STATUS_DECODING, pb.RequestStatus_REQUEST_STATUS_FINISHED
	queued := pb.RequestStatus_REQUEST_STATUS_QUEUED
	script := []*pb.GenerationChunk{
		{Index: 0, Status: queued}, {Index: 1, Status: queued}, {Index: 2, Status: queued},
		{Index: 1, TokenIds: []uint32{'b'}, Text: proto.String("b"), Status: decoding},
		{Index: 1, TokenIndex: 1, Status: finished, FinishReason: pb.FinishReason_FINISH_REASON_EOS,
			Usage: &pb.Usage{PromptTokens: 2, GeneratedTokens: 1}},
		{Index: 0, TokenIds: []uint32{'a', 'a'}, Text: proto.String("aa"), Status: decoding},
		// Never from a conforming server: a chunk after its sequence's terminal one is dropped.
		{Index: 1, TokenIndex: 1, TokenIds: []uint32{'x'}, Text: proto.String("x"), Status: decoding},
		{Index: 2, TokenIds: []uint32{'c'}, Text: proto.String("c"), Status: pb.RequestStatus_REQUEST_STATUS_CANCELLED,
			FinishReason: pb.FinishReason_FINISH_REASON_CANCELLED, Usage: &pb.Usage{PromptTokens: 2, GeneratedTokens: 1}},
		{Index: 0, TokenIndex: 2, TokenIds: []uint32{'a'}, Text: proto.String("a"), Status: finished,
			FinishReason: pb.FinishReason_FINISH_REASON_LENGTH, Usage: &pb.Usage{PromptTokens: 2, GeneratedTokens: 3}},
	}
	fake.mu.Lock()
	fake.chunks = script
	fake.mu.Unlock()

	var order []int
	for chunk, err := range client.Stream(testContext(t), cbserve.Text("hi"), cbserve.WithN(3)) {
		if err != nil {
			t.Fatalf("Stream: %v", err)
		}
		order = append(order, chunk.Index)
		if chunk.Index == 1 && slices.Contains(chunk.TokenIDs, 'x') {
			t.Errorf("Stream yielded a chunk of sequence 1 after its terminal chunk")
		}
	}
	if want := []int{0, 1, 2, 1, 1, 0, 2, 0}; !slices.Equal(order, want) {
		t.Errorf("Stream yielded chunks of sequences %v; want %v (every chunk up to the last sequence's end)", order, want)
	}

	completions, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 3)
	if err != nil {
		t.Fatalf("GenerateN: %v", err)
	}
	for i, want := range []struct {
		text   string
		finish cbserve.FinishReason
		tokens int
	}{{"aaa", cbserve.FinishLength, 3}, {"b", cbserve.FinishEOS, 1}, {"c", cbserve.FinishCancelled, 1}} {
		c := completions[i]
		if c.Index != i || c.Text != want.text || c.FinishReason != want.finish || len(c.TokenIDs) != want.tokens ||
			c.Usage == nil || c.Usage.GeneratedTokens != want.tokens {
			t.Errorf("completion %d = %+v; want %q, %s, %d tokens", i, c, want.text, want.finish, want.tokens)
		}
	}

	// A stream that ends before every sequence has is an error, as is a sequence past n.
	for _, tc := range []struct {
		name    string
		chunks  []*pb.GenerationChunk
		mention string
	}{
		{"sequence 0 never ends", script[:len(script)-1], "1 of its 3 sequences had not"},
		{"a chunk of sequence 3", append(slices.Clip(script[:3]), &pb.GenerationChunk{Index: 3, Status: queued}), "got a chunk of sequence 3"},
	} {
		fake.mu.Lock()
		fake.chunks = tc.chunks
		fake.mu.Unlock()
		var streamErr error
		for _, err := range client.Stream(testContext(t), cbserve.Text("hi"), cbserve.WithN(3)) {
			if err != nil {
				streamErr = err
			}
		}
		if !errors.Is(streamErr, cbserve.ErrInternal) || !strings.Contains(streamErr.Error(), tc.mention) {
			t.Errorf("%s: Stream error %v; want ErrInternal mentioning %q", tc.name, streamErr, tc.mention)
		}
		if _, err := client.GenerateN(testContext(t), cbserve.Text("hi"), 3); !errors.Is(err, cbserve.ErrInternal) {
			t.Errorf("%s: GenerateN error %v; want ErrInternal", tc.name, err)
		}
	}
}

func TestCancelSequenceOnTheWire(t *testing.T) {
	fake, client := dialRecordingFake(t)
	if cancelled, err := client.CancelSequence(testContext(t), "r-1", 2); err != nil || !cancelled {
		t.Errorf("CancelSequence = %v, %v; want true", cancelled, err)
	}
	if cancelled, err := client.Cancel(testContext(t), "r-2"); err != nil || !cancelled {
		t.Errorf("Cancel = %v, %v; want true", cancelled, err)
	}
	calls := fake.callCount()
	if _, err := client.CancelSequence(testContext(t), "r-3", -1); !errors.Is(err, cbserve.ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "index") {
		t.Errorf("CancelSequence(-1): %v; want ErrInvalidArgument naming the index", err)
	}
	if made := fake.callCount() - calls; made != 0 {
		t.Errorf("CancelSequence(-1) made %d calls; want none", made)
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.cancels) != 2 {
		t.Fatalf("%d Cancel calls; want 2", len(fake.cancels))
	}
	if c := fake.cancels[0]; c.GetRequestId() != "r-1" || c.Index == nil || *c.Index != 2 {
		t.Errorf("CancelSequence(r-1, 2) sent %v; want request r-1, index 2", c)
	}
	if c := fake.cancels[1]; c.GetRequestId() != "r-2" || c.Index != nil {
		t.Errorf("Cancel(r-2) sent %v; want request r-2, no index", c)
	}
}
