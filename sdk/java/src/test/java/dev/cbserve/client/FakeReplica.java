package dev.cbserve.client;

import cbserve.v1.Generation;
import cbserve.v1.GenerationServiceGrpc;
import cbserve.v1.Types;
import io.grpc.Grpc;
import io.grpc.InsecureServerCredentials;
import io.grpc.Server;
import io.grpc.Status;
import io.grpc.health.v1.HealthCheckResponse.ServingStatus;
import io.grpc.protobuf.services.HealthStatusManager;
import io.grpc.stub.StreamObserver;
import java.io.IOException;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Deque;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * An in-process stand-in for one replica: a {@code GenerationService} that answers {@code
 * GetModelInfo}, and {@code Generate} with a QUEUED chunk and a finished one of two tokens, unless
 * scripted to fail; and a {@code grpc.health.v1} service whose status the test sets. For what a
 * live server cannot be made to do on cue: refuse a request as a draining replica does, or break a
 * stream midway.
 */
final class FakeReplica implements AutoCloseable {
  private final Server server;
  private final HealthStatusManager health = new HealthStatusManager();
  private final List<Types.GenerationRequest> generated = new ArrayList<>();
  private final Deque<Status> generateErrors = new ArrayDeque<>();
  private final Deque<Status> midStreamErrors = new ArrayDeque<>();
  private int rejectNext;
  private int modelInfoCalls;

  FakeReplica() throws IOException {
    server =
        Grpc.newServerBuilderForPort(0, InsecureServerCredentials.create())
            .addService(new Service())
            .addService(health.getHealthService())
            .build()
            .start();
  }

  /** host:port of the fake. */
  String target() {
    return "127.0.0.1:" + server.getPort();
  }

  /** Sets the health status every service name reports. */
  void serving(boolean serving) {
    health.setStatus("", serving ? ServingStatus.SERVING : ServingStatus.NOT_SERVING);
  }

  /** The next Generate calls end with these statuses before sending anything. */
  synchronized void failNextGenerates(Status... statuses) {
    generateErrors.addAll(List.of(statuses));
  }

  /** The next {@code calls} Generate calls refuse their request with an UNAVAILABLE chunk. */
  synchronized void rejectNextGenerates(int calls) {
    rejectNext += calls;
  }

  /** The next Generate calls that run end with these statuses after their QUEUED chunk. */
  synchronized void breakNextGenerates(Status... statuses) {
    midStreamErrors.addAll(List.of(statuses));
  }

  /** The request of each Generate call so far. */
  synchronized List<Types.GenerationRequest> generated() {
    return List.copyOf(generated);
  }

  synchronized int modelInfoCalls() {
    return modelInfoCalls;
  }

  @Override
  public void close() {
    server.shutdownNow();
    try {
      server.awaitTermination(5, TimeUnit.SECONDS);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }

  private final class Service extends GenerationServiceGrpc.GenerationServiceImplBase {
    @Override
    public void getModelInfo(
        Generation.GetModelInfoRequest request,
        StreamObserver<Generation.GetModelInfoResponse> response) {
      synchronized (FakeReplica.this) {
        modelInfoCalls++;
      }
      response.onNext(
          Generation.GetModelInfoResponse.newBuilder()
              .setModelName("fake")
              .setVocabSize(CbserveServer.VOCAB_SIZE)
              .build());
      response.onCompleted();
    }

    @Override
    public StreamObserver<Generation.GenerateRequest> generate(
        StreamObserver<Generation.GenerateResponse> response) {
      // A session's options come first: its chunks then go batched, and its call ends when the
      // client's does, after any number of requests.
      return new StreamObserver<>() {
        private boolean session;

        @Override
        public void onNext(Generation.GenerateRequest message) {
          if (message.hasOptions()) {
            session = message.getOptions().getBatchChunks();
          } else if (message.hasAdd()) {
            answer(message.getAdd(), new Replies(response, session));
          }
        }

        @Override
        public void onError(Throwable t) {}

        @Override
        public void onCompleted() {
          if (session) {
            response.onCompleted();
          }
        }
      };
    }

    private void answer(Types.GenerationRequest request, Replies response) {
      Status error;
      boolean reject;
      Status broken;
      synchronized (FakeReplica.this) {
        generated.add(request);
        error = generateErrors.poll();
        reject = error == null && rejectNext > 0;
        if (reject) {
          rejectNext--;
        }
        broken = error == null && !reject ? midStreamErrors.poll() : null;
      }
      String id = request.getRequestId();
      if (error != null) {
        response.onError(error.asRuntimeException());
        return;
      }
      if (reject) {
        send(
            response,
            chunk(id, Types.RequestStatus.REQUEST_STATUS_FAILED)
                .setFinishReason(Types.FinishReason.FINISH_REASON_ERROR)
                .setError("the server is stopped or draining")
                .setErrorCode(Status.Code.UNAVAILABLE.value()));
        response.onCompleted();
        return;
      }
      send(response, chunk(id, Types.RequestStatus.REQUEST_STATUS_QUEUED));
      if (broken != null) {
        response.onError(broken.asRuntimeException());
        return;
      }
      send(
          response,
          chunk(id, Types.RequestStatus.REQUEST_STATUS_FINISHED)
              .addTokenIds('o')
              .addTokenIds('k')
              .setText("ok")
              .setFinishReason(Types.FinishReason.FINISH_REASON_LENGTH));
      response.onCompleted();
    }

    private Types.GenerationChunk.Builder chunk(String id, Types.RequestStatus status) {
      return Types.GenerationChunk.newBuilder().setRequestId(id).setStatus(status);
    }

    private void send(Replies response, Types.GenerationChunk.Builder chunk) {
      response.onNext(chunk);
    }
  }

  /**
   * The replies to one request: its chunks, alone or batched as a session's; the end of a single
   * request's call (a session's ends with the client's).
   */
  private record Replies(StreamObserver<Generation.GenerateResponse> call, boolean session) {
    void onNext(Types.GenerationChunk.Builder chunk) {
      Generation.GenerateResponse.Builder message = Generation.GenerateResponse.newBuilder();
      call.onNext(session ? message.addChunks(chunk).build() : message.setChunk(chunk).build());
    }

    void onCompleted() {
      if (!session) {
        call.onCompleted();
      }
    }

    void onError(Throwable t) {
      call.onError(t);
    }
  }
}
