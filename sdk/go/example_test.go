package cbserve_test

// These examples run in `go test` against the test server that TestMain starts (serverAddr and
// adminAddr are its addresses, e.g. "127.0.0.1:50051" and "127.0.0.1:50052"; modelDir is the
// folder of its model). Its model is a tiny random Llama whose tokens are meaningless bytes, so
// the examples print counts and finish reasons rather than text.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"math"
	"path/filepath"
	"time"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

func Example() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	completion, err := client.Generate(ctx, cbserve.Text("The capital of France is"),
		cbserve.WithMaxNewTokens(8), cbserve.WithTemperature(0))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(len(completion.TokenIDs), completion.FinishReason)
	// Output: 8 length
}

func ExampleClient_Stream() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	tokens := 0
	for chunk, err := range client.Stream(ctx, cbserve.Text("Once upon a time"), cbserve.WithMaxNewTokens(16)) {
		if err != nil {
			log.Fatal(err)
		}
		tokens += len(chunk.TokenIDs) // chunk.Text holds the new text
		if chunk.Finished() {
			fmt.Println(chunk.Status, chunk.FinishReason, tokens)
		}
	}
	// Output: finished length 16
}

func ExampleClient_Stream_cancel() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	// Breaking out of the loop cancels the request on the server (and frees its KV cache).
	tokens := 0
	for chunk, err := range client.Stream(ctx, cbserve.Text("Tell me everything"), cbserve.WithMaxNewTokens(500)) {
		if err != nil {
			log.Fatal(err)
		}
		if tokens += len(chunk.TokenIDs); tokens >= 4 {
			break
		}
	}
	// A chunk can carry several tokens (a slow reader gets them merged), so count at least 4.
	fmt.Println("stopped early:", tokens >= 4 && tokens < 500)
	// Output: stopped early: true
}

func ExampleClient_Submit() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	// Token ids work as prompts too; the request runs whether or not anyone reads it.
	id, err := client.Submit(ctx, cbserve.Tokens(72, 105), cbserve.WithMaxNewTokens(10))
	if err != nil {
		log.Fatal(err)
	}
	// Read its tokens from index 4 on (e.g. to resume after a broken connection).
	var tail []uint32
	for chunk, err := range client.Results(ctx, id, 4) {
		if err != nil {
			log.Fatal(err)
		}
		tail = append(tail, chunk.TokenIDs...)
	}
	fmt.Println(len(tail), "tokens from index 4")
	// Output: 6 tokens from index 4
}

func ExampleClient_GenerateN() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	// Three completions of one prompt, computed once: with a seed, completion i is what Generate
	// gives with seed 42 + i.
	completions, err := client.GenerateN(ctx, cbserve.Text("Once upon a time"), 3,
		cbserve.WithMaxNewTokens(8), cbserve.WithTemperature(1), cbserve.WithSeed(42))
	if err != nil {
		log.Fatal(err)
	}
	for _, c := range completions {
		fmt.Println(c.Index, len(c.TokenIDs), c.FinishReason)
	}
	// Output:
	// 0 8 length
	// 1 8 length
	// 2 8 length
}

func ExampleClient_Stream_parallelSampling() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	// With WithN the sequences' chunks interleave: Chunk.Index says whose. Cancel one sequence
	// (CancelSequence); the others run on, and the range ends once every sequence has ended.
	tokens, cancelled := make([]int, 2), false
	for chunk, err := range client.Stream(ctx, cbserve.Text("Tell me everything"), cbserve.WithN(2),
		cbserve.WithMaxNewTokens(200)) {
		if err != nil {
			log.Fatal(err)
		}
		if tokens[chunk.Index] += len(chunk.TokenIDs); chunk.Index == 0 && tokens[0] >= 4 && !cancelled {
			if _, err := client.CancelSequence(ctx, chunk.RequestID, 0); err != nil {
				log.Fatal(err)
			}
			cancelled = true
		}
		if chunk.Finished() {
			fmt.Println(chunk.Index, chunk.FinishReason)
		}
	}
	// Unordered output:
	// 0 cancelled
	// 1 length
}

func ExampleClient_Generate_chat() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	// The test model has no chat template, so the server refuses chat prompts.
	_, err = client.Generate(ctx, cbserve.Chat(cbserve.Message{Role: "user", Content: "Hi"}))
	var e *cbserve.Error
	if errors.As(err, &e) {
		fmt.Println(errors.Is(err, cbserve.ErrInvalidArgument), e.Code)
	}
	// Output: true InvalidArgument
}

func ExampleError() {
	ctx := context.Background()
	client, err := cbserve.NewClient(serverAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	_, err = client.Generate(ctx, cbserve.Text(""))
	fmt.Println(errors.Is(err, cbserve.ErrInvalidArgument))
	for _, err := range client.Results(ctx, "no-such-request", 0) {
		fmt.Println(errors.Is(err, cbserve.ErrNotFound))
	}
	// Output:
	// true
	// true
}

func ExampleAdmin_Pause() {
	ctx := context.Background()
	admin, err := cbserve.NewAdmin(adminAddr, "test-token") // the server's CBSERVE_ADMIN_TOKEN
	if err != nil {
		log.Fatal(err)
	}
	defer admin.Close()

	lease, err := admin.Pause(ctx, cbserve.WithLease(time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release() // ends the Pause call: the server resumes the engine as soon as it sees it end
	status, err := admin.Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("paused:", status.Paused, "holders:", status.PauseHolders, "held:", lease.Held())
	// Output: paused: true holders: 1 held: true
}

func ExampleAdmin_UpdateWeights() {
	ctx := context.Background()
	admin, err := cbserve.NewAdmin(adminAddr, "test-token")
	if err != nil {
		log.Fatal(err)
	}
	defer admin.Close()

	// A tensor's elements go as raw little-endian bytes in C order: here 64 float32 ones, the
	// final norm of the test model (whose hidden size is 64).
	norm := make([]byte, 0, 4*64)
	for range 64 {
		norm = binary.LittleEndian.AppendUint32(norm, math.Float32bits(1))
	}
	update, err := admin.UpdateWeights(ctx, []cbserve.Tensor{
		{Name: "model.norm.weight", DType: "F32", Shape: []int64{64}, Data: norm},
	}, cbserve.WithVersionLabel("step-1"))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(update.TensorsUpdated, "tensor updated, label", update.VersionLabel)
	// Output: 1 tensor updated, label step-1
}

func ExampleAdmin_UpdateWeightsFromPath() {
	ctx := context.Background()
	admin, err := cbserve.NewAdmin(adminAddr, "test-token")
	if err != nil {
		log.Fatal(err)
	}
	defer admin.Close()

	// The path is read by the server: a safetensors file, a folder of them, or an index.
	before, err := admin.Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	update, err := admin.UpdateWeightsFromPath(ctx, filepath.Join(modelDir, "model.safetensors"))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("weight version +1:", update.WeightVersion == before.WeightVersion+1)
	// Output: weight version +1: true
}
