package cbserve_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"

	cbserve "github.com/cbserve/cbserve/sdk/go"
	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// The test server's model (scripts/make_tiny_model.py) has a hidden size of 64, so its norms,
// the final one and those of each layer, are 64 float32s.
const (
	normWeight      = "model.norm.weight"
	layerNormWeight = "model.layers.0.input_layernorm.weight"
	hiddenSize      = 64
)

// fakeAdmin records the messages of each UpdateWeights call and answers version 2.
type fakeAdmin struct {
	pb.UnimplementedAdminServiceServer
	mu       sync.Mutex
	messages []*pb.UpdateWeightsRequest
}

func (f *fakeAdmin) UpdateWeights(stream grpc.ClientStreamingServer[pb.UpdateWeightsRequest, pb.UpdateWeightsResponse]) error {
	for {
		message, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return stream.SendAndClose(&pb.UpdateWeightsResponse{WeightVersion: 2})
		}
		if err != nil {
			return err
		}
		f.mu.Lock()
		f.messages = append(f.messages, message)
		f.mu.Unlock()
	}
}

func startFakeAdmin(t *testing.T, f *fakeAdmin) string {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	pb.RegisterAdminServiceServer(server, f)
	go func() { _ = server.Serve(listener) }()
	t.Cleanup(server.Stop)
	return listener.Addr().String()
}

func TestUpdateWeightsChunksEachTensor(t *testing.T) {
	fake := &fakeAdmin{}
	admin, err := cbserve.NewAdmin(startFakeAdmin(t, fake), "token")
	if err != nil {
		t.Fatalf("NewAdmin: %v", err)
	}
	defer admin.Close()
	data := make([]byte, 250)
	for i := range data {
		data[i] = byte(i)
	}
	tensors := []cbserve.Tensor{
		{Name: "a", DType: "U8", Shape: []int64{10, 25}, Data: data},
		{Name: "empty", DType: "F32", Shape: []int64{0, 3}, Data: nil},
	}
	if _, err := admin.UpdateWeights(testContext(t), tensors, cbserve.WithVersionLabel("step-7"), cbserve.WithChunkSize(100)); err != nil {
		t.Fatalf("UpdateWeights: %v", err)
	}

	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.messages) == 0 || fake.messages[0].GetVersionLabel() != "step-7" {
		t.Fatalf("first message %v; want the version label step-7", fake.messages)
	}
	digest := sha256.Sum256(data)
	emptyDigest := sha256.Sum256(nil)
	type sent struct {
		name   string
		offset uint64
		size   int
		sha256 string
	}
	want := []sent{
		{"a", 0, 100, hex.EncodeToString(digest[:])},
		{"a", 100, 100, hex.EncodeToString(digest[:])},
		{"a", 200, 50, hex.EncodeToString(digest[:])},
		{"empty", 0, 0, hex.EncodeToString(emptyDigest[:])},
	}
	var got []sent
	var reassembled []byte
	for _, message := range fake.messages[1:] {
		chunk := message.GetChunk()
		got = append(got, sent{chunk.GetName(), chunk.GetByteOffset(), len(chunk.GetData()), chunk.GetSha256()})
		wantShape := map[string][]int64{"a": {10, 25}, "empty": {0, 3}}[chunk.GetName()]
		wantDType := map[string]string{"a": "U8", "empty": "F32"}[chunk.GetName()]
		if !slices.Equal(chunk.GetShape(), wantShape) || chunk.GetDtype() != wantDType {
			t.Errorf("chunk of %q: dtype %s, shape %v; want %s, %v", chunk.GetName(), chunk.GetDtype(), chunk.GetShape(), wantDType, wantShape)
		}
		if chunk.GetName() == "a" {
			reassembled = append(reassembled, chunk.GetData()...)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("chunks sent:\n%v\nwant:\n%v", got, want)
	}
	if !bytes.Equal(reassembled, data) {
		t.Errorf("the chunks of tensor a do not reassemble to its Data")
	}
}

func TestUpdateWeightsRejectsMalformedTensorsBeforeSending(t *testing.T) {
	fake := &fakeAdmin{}
	admin, err := cbserve.NewAdmin(startFakeAdmin(t, fake), "token")
	if err != nil {
		t.Fatalf("NewAdmin: %v", err)
	}
	defer admin.Close()
	good := cbserve.Tensor{Name: "good", DType: "F32", Shape: []int64{2}, Data: make([]byte, 8)}
	for _, tc := range []struct {
		name    string
		tensors []cbserve.Tensor
		opts    []cbserve.UpdateWeightsOption
		want    string
	}{
		{"no tensors", nil, nil, "no tensors"},
		{"no name", []cbserve.Tensor{good, {DType: "F32", Shape: []int64{1}, Data: make([]byte, 4)}}, nil, "no name"},
		{"unknown dtype", []cbserve.Tensor{{Name: "x", DType: "float32", Shape: []int64{1}, Data: make([]byte, 4)}}, nil, `unknown dtype "float32"`},
		{"negative dimension", []cbserve.Tensor{{Name: "x", DType: "U8", Shape: []int64{-1}}}, nil, "negative dimension"},
		{"data shorter than the shape", []cbserve.Tensor{good, {Name: "x", DType: "BF16", Shape: []int64{2, 3}, Data: make([]byte, 6)}}, nil, "needs 12 bytes, Data has 6"},
		{"chunk size 0", []cbserve.Tensor{good}, []cbserve.UpdateWeightsOption{cbserve.WithChunkSize(0)}, "WithChunkSize: 0"},
		{"chunk size over the bound", []cbserve.Tensor{good}, []cbserve.UpdateWeightsOption{cbserve.WithChunkSize(cbserve.MaxTensorChunkBytes + 1)}, "WithChunkSize"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := admin.UpdateWeights(testContext(t), tc.tensors, tc.opts...)
			if !errors.Is(err, cbserve.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("UpdateWeights: %v; want ErrInvalidArgument saying %q", err, tc.want)
			}
		})
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.messages) != 0 {
		t.Errorf("%d messages reached the server; want none", len(fake.messages))
	}
}

// greedyTokens generates 8 tokens greedily from a fixed prompt.
func greedyTokens(t *testing.T, client *cbserve.Client) *cbserve.Completion {
	t.Helper()
	completion, err := client.Generate(testContext(t), cbserve.Text("new weights"), cbserve.WithMaxNewTokens(8), cbserve.WithTemperature(0))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	return completion
}

func weightVersion(t *testing.T, admin *cbserve.Admin) uint64 {
	t.Helper()
	status, err := admin.Status(testContext(t))
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	return status.WeightVersion
}

func TestUpdateWeights(t *testing.T) {
	client, admin, ctx := newClient(t), newAdmin(t, adminToken), testContext(t)
	before := weightVersion(t, admin)
	original := greedyTokens(t, client).TokenIDs
	defer func() {
		if t.Failed() { // leave the tests that follow the model's own weights
			_, _ = admin.UpdateWeightsFromPath(context.Background(), modelDir)
		}
	}()

	// A zero final norm zeroes the last hidden states, hence every logit: greedy decoding then
	// picks token 0 at every step. 100-byte chunks split the 256-byte tensor in three.
	zeros := cbserve.Tensor{Name: normWeight, DType: "F32", Shape: []int64{hiddenSize}, Data: make([]byte, 4*hiddenSize)}
	update, err := admin.UpdateWeights(ctx, []cbserve.Tensor{zeros}, cbserve.WithVersionLabel("zero-norm"), cbserve.WithChunkSize(100))
	if err != nil {
		t.Fatalf("UpdateWeights: %v", err)
	}
	want := cbserve.WeightsUpdate{WeightVersion: before + 1, TensorsUpdated: 1, VersionLabel: "zero-norm"}
	if *update != want {
		t.Errorf("UpdateWeights = %+v; want %+v", *update, want)
	}
	if served := weightVersion(t, admin); served != before+1 {
		t.Errorf("Status.WeightVersion = %d after the update; want %d", served, before+1)
	}
	zeroed := greedyTokens(t, client)
	if !slices.Equal(zeroed.TokenIDs, make([]uint32, 8)) || zeroed.WeightVersion != before+1 {
		t.Errorf("with a zero norm: tokens %v at weight version %d; want eight 0s at %d", zeroed.TokenIDs, zeroed.WeightVersion, before+1)
	}

	// The model's own safetensors file, read by the server, puts the original weights back.
	restored, err := admin.UpdateWeightsFromPath(ctx, modelDir)
	if err != nil {
		t.Fatalf("UpdateWeightsFromPath: %v", err)
	}
	if restored.WeightVersion != before+2 || restored.TensorsUpdated < 2 || restored.VersionLabel != "" {
		t.Errorf("UpdateWeightsFromPath = %+v; want weight version %d, every tensor of the model, no label", *restored, before+2)
	}
	if again := greedyTokens(t, client).TokenIDs; !slices.Equal(again, original) {
		t.Errorf("after restoring the model's weights: tokens %v; want the original %v", again, original)
	}
}

func TestUpdateWeightsRejectedByTheServerChangesNothing(t *testing.T) {
	client, admin := newClient(t), newAdmin(t, adminToken)
	before := weightVersion(t, admin)
	original := greedyTokens(t, client).TokenIDs
	// Each tensor update sends a good tensor first (a zero final norm, which would make every
	// token 0): the server must not apply it either.
	zeros := cbserve.Tensor{Name: normWeight, DType: "F32", Shape: []int64{hiddenSize}, Data: make([]byte, 4*hiddenSize)}
	withTensor := func(bad cbserve.Tensor) func(context.Context) (*cbserve.WeightsUpdate, error) {
		return func(ctx context.Context) (*cbserve.WeightsUpdate, error) {
			return admin.UpdateWeights(ctx, []cbserve.Tensor{zeros, bad})
		}
	}
	for _, tc := range []struct {
		name   string
		update func(context.Context) (*cbserve.WeightsUpdate, error)
		want   string
	}{
		{"wrong shape", withTensor(cbserve.Tensor{Name: layerNormWeight, DType: "F32", Shape: []int64{hiddenSize / 2}, Data: make([]byte, 2*hiddenSize)}), "does not match"},
		{"unknown name", withTensor(cbserve.Tensor{Name: "model.no_such.weight", DType: "F32", Shape: []int64{1}, Data: make([]byte, 4)}), "no parameter or buffer"},
		{"integer dtype for a float parameter", withTensor(cbserve.Tensor{Name: layerNormWeight, DType: "I32", Shape: []int64{hiddenSize}, Data: make([]byte, 4*hiddenSize)}), "cannot be converted"},
		{"missing file", func(ctx context.Context) (*cbserve.WeightsUpdate, error) {
			return admin.UpdateWeightsFromPath(ctx, filepath.Join(modelDir, "no-such.safetensors"))
		}, "no such safetensors file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.update(testContext(t)); !errors.Is(err, cbserve.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("the update: %v; want ErrInvalidArgument saying %q", err, tc.want)
			}
		})
	}
	if after := weightVersion(t, admin); after != before {
		t.Errorf("weight version %d after rejected updates; want %d, unchanged", after, before)
	}
	if tokens := greedyTokens(t, client).TokenIDs; !slices.Equal(tokens, original) {
		t.Errorf("tokens %v after rejected updates; want %v, unchanged", tokens, original)
	}
}
