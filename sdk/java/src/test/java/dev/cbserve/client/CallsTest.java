package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.grpc.Status;
import java.nio.channels.ClosedChannelException;
import org.junit.jupiter.api.Test;

/** How a failed call reaches the caller: the exception class a caller catches and retries on. */
class CallsTest {

  @Test
  void aConnectionClosedUnderACallIsUnavailable() {
    // What grpc-java reports when the server dies with a call in flight.
    CbserveException mapped =
        Calls.map(
            Status.UNKNOWN
                .withDescription("channel closed")
                .withCause(new ClosedChannelException())
                .asRuntimeException());
    assertInstanceOf(UnavailableException.class, mapped);
    assertTrue(mapped.getMessage().contains("connection to the server closed"), mapped.getMessage());
  }

  @Test
  void anotherUnknownFailureStaysInternal() {
    assertInstanceOf(
        InternalException.class, Calls.map(Status.UNKNOWN.withDescription("boom").asRuntimeException()));
  }
}
