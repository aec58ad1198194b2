package cbserve_test

// What RL frameworks call, against the real server: logprobs of the distribution tokens are drawn
// from (WithLogprobsMode), the prefix-cache reset (refused with a request in flight unless it
// aborts it), and the weights' checksum (the server's equals ChecksumOf of the model's own file,
// and CheckWeights compares replicas).

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

func TestLogprobsMode(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	generate := func(mode cbserve.LogprobsMode) *cbserve.Completion {
		t.Helper()
		completion, err := client.Generate(ctx, cbserve.Tokens(5, 6, 7, 8), cbserve.WithMaxNewTokens(6),
			cbserve.WithTemperature(0.8), cbserve.WithTopK(2), cbserve.WithSeed(3), cbserve.WithLogprobs(5),
			cbserve.WithLogprobsMode(mode))
		if err != nil {
			t.Fatalf("Generate(mode %d): %v", mode, err)
		}
		return completion
	}
	processed, raw, byDefault := generate(cbserve.LogprobsProcessed), generate(cbserve.LogprobsRaw), generate(cbserve.LogprobsServerDefault)
	if !slices.Equal(processed.TokenIDs, raw.TokenIDs) {
		t.Fatalf("tokens %v (processed) and %v (raw); the mode must not change what is drawn", processed.TokenIDs, raw.TokenIDs)
	}
	for step := range processed.Logprobs {
		kept, every := processed.Logprobs[step], raw.Logprobs[step]
		if len(kept.Top) != 2 || len(every.Top) != 5 || len(byDefault.Logprobs[step].Top) != 5 {
			t.Fatalf("step %d: %d processed, %d raw, %d default alternatives; want 2 (top-k kept two), 5, 5 (the server's default is raw)",
				step, len(kept.Top), len(every.Top), len(byDefault.Logprobs[step].Top))
		}
		mass := math.Exp(float64(kept.Top[0].Logprob)) + math.Exp(float64(kept.Top[1].Logprob))
		if math.Abs(mass-1) > 1e-4 || kept.Logprob < every.Logprob {
			t.Errorf("step %d: the two tokens top-k kept carry %g of the probability (want 1), logprob %g processed, %g raw",
				step, mass, kept.Logprob, every.Logprob)
		}
	}
	if _, err := client.Generate(ctx, cbserve.Text("x"), cbserve.WithLogprobsMode(7)); !errors.Is(err, cbserve.ErrInvalidArgument) ||
		!containsAll(err.Error(), "sampling.logprobs_mode", "unknown value 7") {
		t.Errorf("WithLogprobsMode(7): %v; want ErrInvalidArgument naming it", err)
	}
}

func TestResetPrefixCache(t *testing.T) {
	client, admin, ctx := newClient(t), newAdmin(t, adminToken), testContext(t)
	waitIdle(t, admin, 30*time.Second)
	prompt := make([]uint32, 40) // two full 16-token blocks at least
	for i := range prompt {
		prompt[i] = uint32(10 + i)
	}
	if _, err := client.Generate(ctx, cbserve.Tokens(prompt...), cbserve.WithMaxNewTokens(1)); err != nil {
		t.Fatalf("Generate: %v", err)
	}
	reset, err := admin.ResetPrefixCache(ctx, false)
	if err != nil || reset.DroppedBlocks < 2 || reset.AbortedRequests != 0 {
		t.Fatalf("ResetPrefixCache = %+v, %v; want at least 2 blocks dropped, nothing aborted", reset, err)
	}

	lease, err := admin.Pause(ctx) // the request below stays queued while the pause holds
	if err != nil {
		t.Fatalf("Pause: %v", err)
	}
	defer lease.Release()
	requestID, err := client.Submit(ctx, cbserve.Tokens(5, 6, 7), cbserve.WithMaxNewTokens(4))
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	if _, err := admin.ResetPrefixCache(ctx, false); !errors.Is(err, cbserve.ErrFailedPrecondition) ||
		!strings.Contains(err.Error(), "requests in flight (1 queued or running)") {
		t.Fatalf("ResetPrefixCache with a request in flight: %v; want ErrFailedPrecondition saying why", err)
	}
	reset, err = admin.ResetPrefixCache(ctx, true)
	if err != nil || reset.AbortedRequests != 1 {
		t.Fatalf("ResetPrefixCache(abort) = %+v, %v; want one request aborted", reset, err)
	}
	lease.Release()
	chunks, _ := collect(t, client.Results(ctx, requestID, 0))
	if last := chunks[len(chunks)-1]; last.FinishReason != cbserve.FinishCancelled {
		t.Errorf("the aborted request ended with %q; want %q", last.FinishReason, cbserve.FinishCancelled)
	}
}

func TestWeightsChecksum(t *testing.T) {
	admin, ctx := newAdmin(t, adminToken), testContext(t)
	served, err := admin.WeightsChecksum(ctx, true)
	if err != nil {
		t.Fatalf("WeightsChecksum: %v", err)
	}
	if served.Algorithm != cbserve.ChecksumAlgorithm || served.NumTensors != len(served.Tensors) || served.WeightVersion == 0 {
		t.Fatalf("WeightsChecksum = %s, %d tensors (%d listed), version %d", served.Algorithm, served.NumTensors, len(served.Tensors), served.WeightVersion)
	}
	local, err := cbserve.ChecksumOf(modelFileTensors(t, served))
	if err != nil {
		t.Fatalf("ChecksumOf: %v", err)
	}
	if local.Digest != served.Digest {
		for name, tensor := range served.Tensors {
			if local.Tensors[name].Digest != tensor.Digest {
				t.Errorf("%s: digest %s here, %s on the server", name, local.Tensors[name].Digest, tensor.Digest)
			}
		}
		t.Fatalf("the digest of the model's file %s; the server's %s", local.Digest, served.Digest)
	}
	if summary, err := admin.WeightsChecksum(ctx, false); err != nil || summary.Digest != served.Digest || len(summary.Tensors) != 0 {
		t.Errorf("WeightsChecksum(perTensor false) = %+v, %v; want the same digest and no tensors", summary, err)
	}
}

func TestCheckWeights(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a second server")
	}
	ctx, cancel := context.WithTimeout(context.Background(), startupTimeout)
	defer cancel()
	second, err := startServer(ctx, filepath.Join(t.TempDir(), "second.log"))
	if err != nil {
		t.Fatalf("second server: %v", err)
	}
	t.Cleanup(second.stop)
	first := newAdmin(t, adminToken)
	other, err := cbserve.NewAdmin(second.adminAddr, adminToken)
	if err != nil {
		t.Fatalf("NewAdmin: %v", err)
	}
	defer other.Close()
	expected, err := first.WeightsChecksum(testContext(t), true)
	if err != nil {
		t.Fatalf("WeightsChecksum: %v", err)
	}
	if common, err := cbserve.CheckWeights(testContext(t), nil, first, other); err != nil || common.Digest != expected.Digest {
		t.Fatalf("CheckWeights of two servers of one model = %v, %v; want their digest", common, err)
	}

	zeros := cbserve.Tensor{Name: normWeight, DType: "F32", Shape: []int64{hiddenSize}, Data: make([]byte, 4*hiddenSize)}
	if _, err := other.UpdateWeights(testContext(t), []cbserve.Tensor{zeros}); err != nil {
		t.Fatalf("UpdateWeights: %v", err)
	}
	_, err = cbserve.CheckWeights(testContext(t), expected, first, other)
	var mismatch *cbserve.WeightsMismatchError
	if !errors.As(err, &mismatch) {
		t.Fatalf("CheckWeights after changing one replica: %v; want a *WeightsMismatchError", err)
	}
	if want := map[string][]string{other.Target(): {normWeight}}; mismatch.Reference != "expected" ||
		len(mismatch.Differing) != 1 || !slices.Equal(mismatch.Differing[other.Target()], want[other.Target()]) {
		t.Errorf("mismatch: reference %q, differing %v; want \"expected\", %v", mismatch.Reference, mismatch.Differing, want)
	}
	if message := mismatch.Error(); !strings.Contains(message, "1 of 2 replicas hold other weights than the expected weights: "+other.Target()) ||
		!strings.Contains(message, normWeight) {
		t.Errorf("message %q; want it to name the replica and the tensor", message)
	}
	changed, err := other.WeightsChecksum(testContext(t), true)
	if err != nil {
		t.Fatalf("WeightsChecksum: %v", err)
	}
	if digest, err := cbserve.TensorDigest(zeros); err != nil || changed.Tensors[normWeight].Digest != digest {
		t.Errorf("the pushed tensor's digest on the server %s; TensorDigest of it %s, %v", changed.Tensors[normWeight].Digest, digest, err)
	}
}

// modelFileTensors reads the test model's safetensors file: every tensor of the model's state
// dict, converted to the dtype the server holds it in (served) when that differs (bfloat16 on an
// AMX CPU).
func modelFileTensors(t *testing.T, served *cbserve.WeightsChecksum) []cbserve.Tensor {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(modelDir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	headerSize := binary.LittleEndian.Uint64(data)
	var header map[string]json.RawMessage
	if err := json.Unmarshal(data[8:8+headerSize], &header); err != nil {
		t.Fatal(err)
	}
	body := data[8+headerSize:]
	var tensors []cbserve.Tensor
	for name, raw := range header {
		if name == "__metadata__" {
			continue
		}
		var entry struct {
			DType       string  `json:"dtype"`
			Shape       []int64 `json:"shape"`
			DataOffsets [2]int  `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &entry); err != nil {
			t.Fatal(err)
		}
		tensor := cbserve.Tensor{Name: name, DType: entry.DType, Shape: entry.Shape, Data: body[entry.DataOffsets[0]:entry.DataOffsets[1]]}
		if held := served.Tensors[name].DType; held == "BF16" && entry.DType == "F32" {
			tensor = cbserve.Tensor{Name: name, DType: held, Shape: entry.Shape, Data: float32ToBFloat16(tensor.Data)}
		}
		tensors = append(tensors, tensor)
	}
	return tensors
}

// float32ToBFloat16 rounds little-endian float32s to bfloat16 to the nearest, ties to even, as
// torch does.
func float32ToBFloat16(data []byte) []byte {
	out := make([]byte, len(data)/2)
	for i := range len(data) / 4 {
		bits := binary.LittleEndian.Uint32(data[4*i:])
		rounded := uint16((bits + 0x7FFF + (bits>>16)&1) >> 16)
		if math.IsNaN(float64(math.Float32frombits(bits))) {
			rounded = 0x7FC0
		}
		binary.LittleEndian.PutUint16(out[2*i:], rounded)
	}
	return out
}
