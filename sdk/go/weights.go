package cbserve

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"iter"
	"maps"
	"math"
	"slices"

	"google.golang.org/grpc/codes"

	pb "github.com/cbserve/cbserve/sdk/go/gen/cbserve/v1"
)

// MaxTensorChunkBytes is the most tensor bytes UpdateWeights puts in one message: the bound the
// protocol sets for clients, well under gRPC's default 4 MiB message limit.
const MaxTensorChunkBytes = 1 << 20

// dtypeSizes maps the safetensors dtype names the server accepts to their bytes per element.
var dtypeSizes = map[string]int64{
	"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
	"I64": 8, "I32": 4, "I16": 2, "I8": 1,
	"U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}

// Tensor is one named tensor of Admin.UpdateWeights.
type Tensor struct {
	// Name is the parameter's name in the model's state dict, e.g.
	// "model.layers.0.mlp.up_proj.weight".
	Name string
	// DType is the element type as safetensors names it: "F64", "F32", "F16", "BF16", "F8_E4M3",
	// "F8_E5M2", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8" or "BOOL". It need not be
	// the parameter's: the server converts floating-point types to one another, and integer types.
	DType string
	// Shape is the tensor's shape; it must equal the parameter's.
	Shape []int64
	// Data holds the elements in C order, little-endian, as safetensors stores them: the product
	// of Shape times the size of DType bytes. UpdateWeights does not copy or modify it.
	Data []byte
}

// check returns an ErrInvalidArgument error when t cannot be sent as it is.
func (t *Tensor) check() error {
	if t.Name == "" {
		return newError(codes.InvalidArgument, "a tensor has no name")
	}
	itemSize, ok := dtypeSizes[t.DType]
	if !ok {
		return newError(codes.InvalidArgument, "tensor %q: unknown dtype %q; expected one of %v",
			t.Name, t.DType, slices.Sorted(maps.Keys(dtypeSizes)))
	}
	elements := int64(1)
	for _, dim := range t.Shape {
		if dim < 0 {
			return newError(codes.InvalidArgument, "tensor %q: negative dimension in shape %v", t.Name, t.Shape)
		}
		if dim > 0 && elements > math.MaxInt64/itemSize/dim {
			return newError(codes.InvalidArgument, "tensor %q: shape %v is too large", t.Name, t.Shape)
		}
		elements *= dim
	}
	if want := elements * itemSize; int64(len(t.Data)) != want {
		return newError(codes.InvalidArgument, "tensor %q of dtype %s and shape %v needs %d bytes, Data has %d",
			t.Name, t.DType, t.Shape, want, len(t.Data))
	}
	return nil
}

// UpdateWeightsOption configures Admin.UpdateWeights and Admin.UpdateWeightsFromPath.
type UpdateWeightsOption struct {
	apply func(*updateWeightsConfig)
}

type updateWeightsConfig struct {
	label     *string
	chunkSize int
}

// WithVersionLabel labels the new weights (e.g. with a training step); the server logs the
// label and returns it in WeightsUpdate.VersionLabel.
func WithVersionLabel(label string) UpdateWeightsOption {
	return UpdateWeightsOption{func(c *updateWeightsConfig) { c.label = &label }}
}

// WithChunkSize sets the most bytes of a tensor sent in one message, in [1,
// MaxTensorChunkBytes] (default MaxTensorChunkBytes).
func WithChunkSize(n int) UpdateWeightsOption {
	return UpdateWeightsOption{func(c *updateWeightsConfig) { c.chunkSize = n }}
}

func updateWeightsOptions(opts []UpdateWeightsOption) (updateWeightsConfig, error) {
	cfg := updateWeightsConfig{chunkSize: MaxTensorChunkBytes}
	for _, opt := range opts {
		if opt.apply != nil {
			opt.apply(&cfg)
		}
	}
	if cfg.chunkSize < 1 || cfg.chunkSize > MaxTensorChunkBytes {
		return cfg, newError(codes.InvalidArgument, "WithChunkSize: %d is not in [1, %d]", cfg.chunkSize, MaxTensorChunkBytes)
	}
	return cfg, nil
}

// UpdateWeights replaces model weights in place with tensors, streamed on the UpdateWeights RPC:
// each tensor in chunks of at most MaxTensorChunkBytes (see WithChunkSize), every chunk carrying
// the SHA-256 of the whole tensor. The server checks every tensor (known name, equal shape,
// convertible dtype, complete bytes, checksum) before it changes any weight, then applies the
// update under a pause of its own: in-flight requests keep their KV cache, and their later tokens
// come from the new weights (Chunk.WeightVersion). A bad update fails with ErrInvalidArgument and
// changes nothing; so does a malformed Tensor, found here before anything is sent. Concurrent
// updates are applied one after the other.
//
// The call has no default deadline (a large model takes a while to stream): bound it with ctx.
// Cancelling ctx before the server has answered cancels the update.
func (a *Admin) UpdateWeights(ctx context.Context, tensors []Tensor, opts ...UpdateWeightsOption) (*WeightsUpdate, error) {
	cfg, err := updateWeightsOptions(opts)
	if err != nil {
		return nil, err
	}
	if len(tensors) == 0 {
		return nil, newError(codes.InvalidArgument, "UpdateWeights: no tensors to send")
	}
	for i := range tensors {
		if err := tensors[i].check(); err != nil {
			return nil, err
		}
	}
	return a.updateWeights(ctx, weightsRequests(cfg.label, tensors, cfg.chunkSize))
}

// UpdateWeightsFromPath replaces model weights in place with the tensors of a safetensors file
// on the server's file system (or of a folder of them, or of a "*.safetensors.index.json"): each
// replaces the parameter of the same name. Checks, errors and deadline are as for UpdateWeights;
// WithChunkSize does not apply.
func (a *Admin) UpdateWeightsFromPath(ctx context.Context, path string, opts ...UpdateWeightsOption) (*WeightsUpdate, error) {
	cfg, err := updateWeightsOptions(opts)
	if err != nil {
		return nil, err
	}
	if path == "" {
		return nil, newError(codes.InvalidArgument, "UpdateWeightsFromPath: the path is empty")
	}
	return a.updateWeights(ctx, func(yield func(*pb.UpdateWeightsRequest) bool) {
		if cfg.label != nil && !yield(labelRequest(*cfg.label)) {
			return
		}
		yield(&pb.UpdateWeightsRequest{Payload: &pb.UpdateWeightsRequest_SafetensorsPath{SafetensorsPath: path}})
	})
}

// updateWeights sends the stream of requests, half-closes it and returns the server's answer.
func (a *Admin) updateWeights(ctx context.Context, requests iter.Seq[*pb.UpdateWeightsRequest]) (*WeightsUpdate, error) {
	// Returning before the half-close cancels the call, and the server applies nothing. The
	// client's timeouts do not apply: a large model takes as long as it takes to send.
	callCtx, cancel, deadline := clientTimeout{}.start(ctx)
	defer cancel()
	stream, err := a.admin.UpdateWeights(callCtx)
	if err != nil {
		return nil, deadline.error(err)
	}
	for request := range requests {
		err := stream.Send(request)
		if errors.Is(err, io.EOF) {
			break // the server has ended the call: CloseAndRecv returns its status
		}
		if err != nil {
			return nil, deadline.error(err)
		}
	}
	response, err := stream.CloseAndRecv()
	if err != nil {
		return nil, deadline.error(err)
	}
	return &WeightsUpdate{
		WeightVersion:  response.GetWeightVersion(),
		TensorsUpdated: int(response.GetTensorsUpdated()),
		VersionLabel:   response.GetVersionLabel(),
	}, nil
}

func labelRequest(label string) *pb.UpdateWeightsRequest {
	return &pb.UpdateWeightsRequest{Payload: &pb.UpdateWeightsRequest_VersionLabel{VersionLabel: label}}
}

// weightsRequests yields the UpdateWeights stream of tensors: the label first if there is one,
// then each tensor's chunks in order, consecutive slices of Data of at most chunkSize bytes (an
// empty tensor is one chunk without data). The SHA-256 of a tensor is computed as its first
// chunk is due, so a caller that stops early hashes nothing more.
func weightsRequests(label *string, tensors []Tensor, chunkSize int) iter.Seq[*pb.UpdateWeightsRequest] {
	return func(yield func(*pb.UpdateWeightsRequest) bool) {
		if label != nil && !yield(labelRequest(*label)) {
			return
		}
		for i := range tensors {
			t := &tensors[i]
			digest := sha256.Sum256(t.Data)
			checksum := hex.EncodeToString(digest[:])
			for offset := 0; offset == 0 || offset < len(t.Data); offset += chunkSize {
				chunk := &pb.TensorChunk{
					Name:       t.Name,
					Dtype:      t.DType,
					Shape:      t.Shape,
					ByteOffset: uint64(offset),
					Data:       t.Data[offset:min(offset+chunkSize, len(t.Data))],
					Sha256:     checksum,
				}
				if !yield(&pb.UpdateWeightsRequest{Payload: &pb.UpdateWeightsRequest_Chunk{Chunk: chunk}}) {
					return
				}
			}
		}
	}
}
